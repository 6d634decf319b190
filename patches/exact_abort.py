"""Patch: an abort names exactly one request (SGLang 0.5.23).

SGLang 0.5.23's scheduler matches an `AbortReq` by prefix: every queue it searches tests
`req.rid.startswith(recv_req.rid)`. So `POST /abort_request {"rid": "a1"}` also ended `a10`; a
client that dropped its own stream with `rid: "x"` ended `x7f3e` and `xyz` two seconds later
(the tokenizer manager's disconnect abort); sixteen throwaway streams with rids "0".."f" ended
other clients' streams whose ids the server made (uuid hex). Our own error-path aborts
(`request_isolation._stream_failing_alone`, the Responses API's) went through the same match.
The tokenizer manager already sends an abort only for a rid it tracks (one request, or each of
a batch's / an `n > 1` request's own rids) or for `abort_all`; the prefix match in the
scheduler only ever widened it to other requests. (Upstream later added an explicit
`prefix: true` to AbortReq for aborting a family of requests, sgl-project/sglang#30912; 0.5.23
has no such field, and `abort_all` stays the operator's tool: `/abort_request` is an operator
route, `patches/operator_routes.py`.)

Targets (REPLACE): `Scheduler.abort_request`, `GrammarManager.abort_requests` and the encoder
receiver's `abort_waiting_requests`, each upstream's own source with every
`<x>.rid.startswith(recv_req.rid)` turned into `<x>.rid == recv_req.rid`, compiled in its own
module's namespace (line numbers kept). The count of such matches is pinned per function: an
SGLang whose source differs stops the plugin's load with a message rather than serving prefix
aborts. Not patched: the dLLM queue (`dllm_manager.pop_aborted_reqs`), which gpt-oss never uses.

An abort also names only the request that owns the rid now. A client may choose its rid, and SGLang
0.5.23's tokenizer manager aborted whatever request held a rid, whoever started it: a stream refused as
a duplicate of another tenant's running rid, or any stream that ended less than two seconds before its
client reused the rid, ended that other request two seconds later (`create_abort_task`, the disconnect
abort of every streamed endpoint). `owns(obj, state)` holds when the tokenizer manager registered the
state for that request object (itself, or one of the sub-requests of a batch or n > 1 request, which
`obj[i]` caches): `TokenizerManager.create_abort_task` (REPLACE) and our own error-path aborts
(`request_isolation._stream_failing_alone`, the Responses API's) abort through it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import textwrap

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

PREFIX_MATCH = re.compile(r"\b([\w.]+)\.rid\.startswith\(recv_req\.rid\)")

# (module, qualified name, how many prefix matches SGLang 0.5.23's source holds)
TARGETS = (
    ("sglang.srt.managers.scheduler", "Scheduler.abort_request", 8),
    ("sglang.srt.constrained.grammar_manager", "GrammarManager.abort_requests", 1),
    ("sglang.srt.disaggregation.encoder.receiver", "MMReceiverBase.abort_waiting_requests", 1),
)


class UnexpectedUpstreamSource(RuntimeError):
    pass


def exact_match_source(source: str, expected: int, where: str) -> str:
    rewritten, count = PREFIX_MATCH.subn(r"\1.rid == recv_req.rid", source)
    if count != expected:
        raise UnexpectedUpstreamSource(
            f"sglang-ext exact_abort: {where} holds {count} rid prefix matches, {expected} expected for the pinned "
            "SGLang; this patch must be revisited for the installed version")
    return rewritten


def exact_match_function(module_name: str, qualname: str, expected: int):
    module = importlib.import_module(module_name)
    owner = module
    for part in qualname.split("."):
        owner = getattr(owner, part)
    function = inspect.unwrap(owner)
    lines, first = inspect.getsourcelines(function)
    source = exact_match_source(textwrap.dedent("".join(lines)), expected, f"{module_name}.{qualname}")
    namespace: dict = {}
    code = compile("\n" * (first - 1) + source, inspect.getsourcefile(function), "exec")
    exec(code, module.__dict__, namespace)  # noqa: S102 - upstream's own source, one operator changed
    replacement = namespace[function.__name__]
    replacement.__doc__ = f"{function.__doc__ or ''}\n(sglang-ext: rids match exactly, patches/exact_abort.py)"
    return replacement


def rids_of(obj) -> list[str]:
    rid = getattr(obj, "rid", None)
    return [r for r in (rid if isinstance(rid, list) else [rid]) if r]


def owns(obj, state) -> bool:
    """Whether the tokenizer manager's request `state` was registered for request `obj`, not for another
    request under the same rid."""
    if state is None:
        return False
    return state.obj is obj or any(state.obj is sub for sub in obj.__dict__.get("_sub_obj_cache", {}).values())


def abort_owned(tokenizer_manager, obj) -> list[str]:
    """Abort each of `obj`'s rids that its own request still holds; returns those aborted."""
    aborted = [rid for rid in rids_of(obj) if owns(obj, tokenizer_manager.rid_to_state.get(rid))]
    for rid in aborted:
        tokenizer_manager.abort_request(rid)
    return aborted


def create_abort_task(self, obj):
    """Upstream's disconnect abort (two seconds after a streamed response ends), of `obj`'s own requests only."""
    from fastapi import BackgroundTasks  # as upstream

    async def abort_request():
        await asyncio.sleep(2)
        abort_owned(self, obj)

    background_tasks = BackgroundTasks()
    background_tasks.add_task(abort_request)
    return background_tasks


def register() -> None:
    for module_name, qualname, expected in TARGETS:
        HookRegistry.register(f"{module_name}.{qualname}", exact_match_function(module_name, qualname, expected),
                              HookType.REPLACE)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.create_abort_task",
                          create_abort_task, HookType.REPLACE)
