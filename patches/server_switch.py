"""An on/off server flag that every process of the server sees (SGLang 0.5.23).

`ServerArgs.add_cli_args` (AFTER) adds the flag, so `launch_server --help` lists it; `ServerArgs.from_cli_args`
(AFTER) carries it as `ENV_VAR=1`: ServerArgs is a sealed struct that drops undeclared fields, and the spawned
scheduler and detokenizer processes inherit the environment. Not a patch of its own: the patches that own a
switch register it.
"""

from __future__ import annotations

import os

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"


class ServerSwitch:
    def __init__(self, flag: str, env_var: str, help: str):
        self.flag, self.env_var, self.help = flag, env_var, help
        self.dest = flag.lstrip("-").replace("-", "_")

    def is_on(self) -> bool:
        return os.environ.get(self.env_var) == "1"

    def add_flag(self, result, parser):
        if self.flag not in parser._option_string_actions:
            parser.add_argument(self.flag, action="store_true", default=False, help=self.help)

    def carry(self, server_args, cls, args):
        if getattr(args, self.dest, False):
            os.environ[self.env_var] = "1"
        else:
            os.environ.pop(self.env_var, None)
        return server_args

    def register(self) -> None:
        HookRegistry.register(ADD_CLI_ARGS, self.add_flag, HookType.AFTER)
        HookRegistry.register(FROM_CLI_ARGS, self.carry, HookType.AFTER)
