"""A custom logit processor that makes the model say a given token sequence.

Serves a scripted Harmony output through the real server (reasoning, preambles, tool calls,
malformed headers), whatever the weights: start the server with
``--enable-custom-logit-processor`` and send

    custom_logit_processor = ForcedTokens.to_str()
    custom_params = {"forced_token_ids": [...]}

(OpenAI requests: both in ``extra_body``). Output token k is ``forced_token_ids[k]``; past the
end the model samples freely. The class is pickled by reference, so the scheduler imports it
from here.
"""

from __future__ import annotations

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

PARAM = "forced_token_ids"
_STEP = "_sglang_ext_forced_step"


class ForcedTokens(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list or []):
            forced = (params or {}).get(PARAM)
            req = (params or {}).get("__req__")
            if not forced or req is None:
                continue
            # Counted here, not read off req.output_ids: under the overlap scheduler that list is
            # one token behind while the next one is sampled.
            step = getattr(req, _STEP, 0)
            setattr(req, _STEP, step + 1)
            if step < len(forced):
                logits[row, :] = float("-inf")
                logits[row, forced[step]] = 0.0
        return logits
