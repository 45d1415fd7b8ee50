"""`radixserve` command line: one sub-command per job, each defined next to its code."""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> module exposing add_arguments(parser) and run(args) -> int
COMMANDS = {
    "serve": ("radixserve.server.cli", "start the OpenAI-compatible HTTP server"),
    "chat": ("radixserve.engine.chat_cli", "stream one chat reply for a prompt"),
    "batch": ("radixserve.server.batch_job", "run an OpenAI-format batch file offline"),
    "replay": ("radixserve.replay.cli", "replay a request trace against the prefix cache"),
    "plan": ("radixserve.planner.cli", "how many requests and tokens fit in the KV cache"),
    "kv-events": ("radixserve.events.cli", "print or record a KV event stream as JSON lines"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser_for(argv)
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


def build_parser_for(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv else None
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
