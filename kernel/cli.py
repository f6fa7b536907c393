"""Command lines on click, keeping the contract every `main(argv)` had: the command's return value
is the exit code, and a usage error prints the usage and exits 2 (SystemExit, as argparse did).

    @click.command("trainer", cls=Command, help=__doc__)
    @click.option("--config", help="...")
    def cli(config): ...                  # returns the exit code

    def main(argv=None) -> int:
        return run(cli, argv, "trainer")  # `python -m trainer`, and the `asyncrl trainer` subcommand
"""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import click

# -h as well: argparse took both, and the docs and scripts may use either
CONTEXT = {"help_option_names": ["-h", "--help"]}


class _RawHelp:
    """A docstring's help as written (aligned tables, command examples), not rewrapped; a one-line
    help is wrapped as usual."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.help and "\n" not in self.help.strip():
            super().format_help_text(ctx, formatter)
        elif self.help:
            formatter.write_paragraph()
            formatter.write(textwrap.indent(textwrap.dedent(self.help).strip("\n"), "  ") + "\n")


class Command(_RawHelp, click.Command):
    def __init__(self, *args, **kw):
        kw.setdefault("context_settings", CONTEXT)
        super().__init__(*args, **kw)


class Group(_RawHelp, click.Group):
    command_class = Command
    group_class = type  # sub-groups are of this class too

    def __init__(self, *args, **kw):
        kw.setdefault("context_settings", CONTEXT)
        super().__init__(*args, **kw)


def run(cmd: click.Command, argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run `cmd` on argv (default: sys.argv[1:]); -> its callback's return value (None: 0)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rv = cmd.main(args=args, prog_name=prog, standalone_mode=False)
    except click.ClickException as e:  # UsageError: exit code 2
        e.show()
        raise SystemExit(e.exit_code) from None
    except click.Abort as e:  # click turns Ctrl-C into Abort: give the caller the interrupt back
        if isinstance(e.__context__, (KeyboardInterrupt, EOFError)):
            raise e.__context__ from None
        raise SystemExit(1) from None
    return 0 if rv is None else rv


def parse(cmd: click.Command, argv: list[str] | None = None, prog: str | None = None) -> SimpleNamespace:
    """The parameters `cmd` gets from argv, its callback not run (usage errors exit 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        with cmd.make_context(prog, args) as ctx:
            return SimpleNamespace(**ctx.params)
    except click.exceptions.Exit as e:  # --help
        raise SystemExit(e.exit_code) from None
    except click.ClickException as e:
        e.show()
        raise SystemExit(e.exit_code) from None


def one_of(a: SimpleNamespace, *names: str, required: bool = False) -> None:
    """At most one (with `required`, exactly one) of these options given: argparse's mutually
    exclusive group, and its messages."""
    ctx = click.get_current_context()
    flag = {p.name: p.opts[0] for p in ctx.command.params}
    given = [n for n in names if getattr(a, n) not in (None, False)]
    if len(given) > 1:
        raise click.UsageError(f"argument {flag[given[1]]}: not allowed with argument {flag[given[0]]}", ctx)
    if required and not given:
        raise click.UsageError(f"one of the arguments {' '.join(flag[n] for n in names)} is required", ctx)
