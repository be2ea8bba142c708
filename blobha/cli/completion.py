"""``blobha completion bash|zsh``: the shell's completion script, made by shtab from the
command line's own parser, so it never falls behind a new command or option."""

from __future__ import annotations

import argparse

from blobha.cli.output import print_json

SHELLS = ("bash", "zsh")
#: Options whose argument is a path, by metavar: completed with the shell's file names.
_FILE_METAVARS = frozenset({"FILE", "TOKEN_FILE"})
_DIR_METAVARS = frozenset({"DIR"})


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    import shtab  # only here: no other command needs it

    for action in _actions(parser):
        if action.metavar in _FILE_METAVARS:
            action.complete = shtab.FILE  # type: ignore[attr-defined]
        elif action.metavar in _DIR_METAVARS:
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
    return str(shtab.complete(parser, shell=shell))


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    actions = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                actions += _actions(sub)
    return actions


def cmd_completion(args: argparse.Namespace) -> int:
    text = script(args.root, args.shell)
    if args.json:
        print_json({"shell": args.shell, "script": text})
    else:
        print(text, end="" if text.endswith("\n") else "\n")
    return 0
