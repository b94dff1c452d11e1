"""A click command whose usage errors are one line, as every other refusal of the tools is.

click prints a bad option or value as four lines (``Usage: ...``, ``Try '... --help' for help.``, a blank line,
``Error: ...``); ``python -m dlrm.preprocess`` said it in one, the other tools (train.py, the generator, the MLPerf
import, relayout, sweeps, the checkpoint merge) in click's four. `OneLineUsageCommand` prints
``error: <what is wrong> (see <program> --help)`` on stderr and exits 2, for all of them.

`NonEmptyPath` is the tools' click path type that refuses an empty value as such. ``Path("")`` is the working
directory: ``-o "$OUT"`` with OUT unset wrote ``python -m dlrm.preprocess``'s dataset into it (with --overwrite,
replacing a train/ or test/ folder there), and the other data tools named the empty value ".": ``--output .: name the
dataset directory itself, not . or ..`` (relayout, the MLPerf import), ``--out .`` (the generator), ". is a directory"
(its --raw-tsv).
"""

from __future__ import annotations

import sys

import click

EXIT_USAGE = 2  # click's own code for a usage error
EXIT_INTERRUPTED = 130


class OneLineUsageCommand(click.Command):
    """click.Command with one-line usage errors (exit 2) and a one-line Ctrl-C while click parses (exit 130).

    Example:
        >>> @click.command(cls=OneLineUsageCommand)
        ... @click.option("--n", type=click.IntRange(min=1))
        ... def tool(n):
        ...     pass
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     try:
        ...         tool(["--n", "0"], prog_name="tool")
        ...     except SystemExit as e:
        ...         print(e.code)
        2
        >>> print(err.getvalue(), end="")
        error: Invalid value for '--n': 0 is not in the range x>=1. (see tool --help)
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's main run non-standalone, so that its errors come here to be printed in one line."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort:
            self.fail_line("interrupted", EXIT_INTERRUPTED)
        except click.ClickException as e:
            hint = f" (see {prog_name or _program_name()} --help)" if isinstance(e, click.UsageError) else ""
            self.fail_line(" ".join(e.format_message().split()) + hint, e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)

    def fail_line(self, message: str, code: int) -> None:
        """Print ``error: message`` on stderr and exit with ``code``."""
        click.echo(f"error: {message}", err=True)
        sys.exit(code)



def _program_name() -> str:
    """The program as click names it in its usage line (``python -m dlrm.sweep``, ``train.py``)."""
    try:
        from click.utils import _detect_program_name  # (click's own, private: the basename where it is gone)
    except ImportError:
        import os

        return os.path.basename(sys.argv[0])
    return _detect_program_name()


class NonEmptyPath(click.Path):
    """click.Path refusing ``""``, and a path no file can have (`dlrm.path_checks.path_problem`: a name over 255
    bytes, a path over PATH_MAX, a symbolic link loop on the way), which was taken for a missing file or reached
    an `os.stat` that raised later (a traceback, "a bug in dlrm", from train.py's and a sweep's --config).

    Args:
        what: what the option names, for the message (default: the data tools' --output, a dataset directory).
        **kwargs: click.Path's (``exists``, ``file_okay``, ``path_type``...).

    Example:
        >>> @click.command()
        ... @click.option("--output", type=NonEmptyPath())
        ... def tool(output):
        ...     pass
        >>> try:
        ...     tool(["--output", ""], standalone_mode=False)
        ... except click.BadParameter as e:
        ...     print(e.format_message())
        Invalid value for '--output': empty path (name the dataset directory to create)
    """

    def __init__(self, what: str = "the dataset directory to create", **kwargs) -> None:
        super().__init__(**kwargs)
        self.what = what

    def convert(self, value, param, ctx):
        """``value`` as click.Path converts it, unless it is empty."""
        if isinstance(value, str) and value == "":
            self.fail(f"empty path (name {self.what})", param, ctx)
        from dlrm.path_checks import path_problem, shown_path

        # (a path through a file too: the tools' own checks said "no such file", "checkpoint not found", "cannot be
        # created" of it, naming no option)
        problem = path_problem(value, under_file=True) if isinstance(value, (str, bytes)) else None
        if problem is not None:
            self.fail(f"{shown_path(value)}: {problem}", param, ctx)
        return super().convert(value, param, ctx)
