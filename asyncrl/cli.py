"""The `asyncrl` command: Typer owns subcommands and help; Hydra owns composition, overrides and sweeps.

Heavy imports (torch, transformers, hydra) happen inside the commands so `asyncrl --help` stays fast.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from asyncrl import __version__

if TYPE_CHECKING:
    from asyncrl.run_plan import RunPlan


class _UntypedFlags:
    """Help that shows no type beside a flag (``--help <bool>``): a flag takes no value."""

    def get_params(self, ctx):  # type: ignore[no-untyped-def]
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class _Group(_UntypedFlags, TyperGroup):
    pass


class _Command(_UntypedFlags, TyperCommand):
    pass


app = typer.Typer(
    name="asyncrl",
    cls=_Group,
    help="Asynchronous GRPO: generation and training overlap, weights move to the server as training goes.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}
_OVERRIDES = "[OPTIONS] [OVERRIDES]..."


def _version(value: bool) -> None:
    if value:
        typer.echo(f"asyncrl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """asyncrl: asynchronous GRPO trainer for language models."""


@app.command(cls=_Command, context_settings=_EXTRA, options_metavar=_OVERRIDES)
def train(
    ctx: typer.Context,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Sweep: one job per combination of values."),
    cfg: str = typer.Option(None, "--cfg", "-c", help="Print the composed config (job|hydra|all) and exit."),
) -> None:
    """Train. Extra arguments are Hydra overrides: [bold]+recipe=deepmath trainer.learning_rate=3e-6[/bold]"""
    import os
    import time

    os.environ["ASYNCRL_COMMAND_STARTED_AT"] = str(time.time())  # launch.py's COMMAND_STARTED_ENV: before the imports
    try:
        from asyncrl.launch import run_hydra

        _checked(lambda: _preflight(list(ctx.args), multirun, validate=cfg is None))
        run_hydra(list(ctx.args), multirun=multirun, cfg=cfg)
    finally:  # the first job took it; a refused command leaves none for a later one in this process
        os.environ.pop("ASYNCRL_COMMAND_STARTED_AT", None)


def _preflight(overrides: list[str], multirun: bool, validate: bool) -> None:
    """Compose (each value of a sweep), validate, and make the job's startup checks, before Hydra makes the run
    directory: Hydra reports these over many lines or as a traceback, and a refused run must leave no directory
    behind nor change an earlier run's."""
    from omegaconf import open_dict

    from asyncrl.config.compose import compose
    from asyncrl.config.messages import check_run_dir
    from asyncrl.launch import check_startup
    from asyncrl.plan.assemble import plan_run

    jobs = []
    for variant in _sweep_variants(overrides) if multirun else [overrides]:
        composed = compose(variant, return_hydra_config=True)
        with open_dict(composed):
            hydra = composed.pop("hydra")
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        run_dir = str(hydra.sweep.dir if multirun else hydra.run.dir)
        check_run_dir(run_dir, key)
        if validate:
            jobs.append((plan_run(composed), _job_dirs(Path(run_dir), multirun)))
    notes = set()
    for plan, job_dirs in jobs:  # once every value is valid: these look at the machine and the directories
        notes.add(_check_before_loading(plan))
        check_startup(plan.config, job_dirs)
    for note in notes - {None}:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)


def _check_before_loading(plan: RunPlan) -> str | None:
    """This machine can run the server asked for and has, or can download, every Hub id the run reads: checked
    before the job loads anything, which would otherwise fail late (vLLM's launch, after the data and tokenizer) or
    slowly (a load waiting through the Hub's retries, then a traceback). Returns a note when the Hub does not answer
    and the cache serves."""
    from asyncrl.hub_push import check_completions_hub, check_hub_push
    from asyncrl.hub_sources import check_hub_sources

    config = plan.config
    if config.server.launch and plan.server_backend == "vllm":
        from asyncrl.plan.assemble import placed
        from asyncrl.plan.decide import visible_gpus
        from asyncrl.serving.vllm import check_launchable

        check_launchable(config)
        placed(plan, visible_gpus())  # as many GPUs as the split needs (the job places its plan on them)
    check_hub_push(config)
    check_completions_hub(config)
    return check_hub_sources(config)


def _job_dirs(run_dir: Path, multirun: bool) -> list[Path]:
    """Where the jobs will train: the run directory, or a sweep's job directories already there (Hydra numbers
    them 0, 1, ... as it starts the jobs: hydra.sweep.subdir)."""
    if not multirun:
        return [run_dir]
    return sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.isdigit()) if run_dir.is_dir() else []


def _sweep_variants(overrides: list[str]) -> list[list[str]]:
    """Every sweep override (``key=a,b``, ``key=range(...)``) at its first value, then each other value of each
    sweep with the rest at their first: every value is checked once, not every combination."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.input_line] for o in parsed]
    keys = [f"{o.get_key_element()}=" if o.is_sweep_override() else "" for o in parsed]
    first = [key + options[0] for key, options in zip(keys, values, strict=True)]
    variants = [first]
    for i, options in enumerate(values):
        variants += [[*first[:i], keys[i] + value, *first[i + 1 :]] for value in options[1:]]
    return variants


@app.command(cls=_Command, context_settings=_EXTRA, options_metavar=_OVERRIDES)
def config(
    ctx: typer.Context,
    server_command: bool = typer.Option(
        False, "--server-command", help="Print the server command line instead (one per server.replicas)."
    ),
    plan_file: bool = typer.Option(
        False, "--plan", help="Print the run plan instead (JSON: the plan.json a run's processes read)."
    ),
    run_dir: Annotated[
        Path | None,
        typer.Option(help="A run's own: the config and plan its plan.json holds (no overrides), its commands."),
    ] = None,
) -> None:
    """Print the composed, validated config as YAML (same overrides as train)."""
    from asyncrl.config.compose import compose, to_yaml
    from asyncrl.plan.assemble import plan_run

    if run_dir is not None:
        _print_run(run_dir, list(ctx.args), plan_file=plan_file, server_command=server_command)
        return
    plan = _checked(lambda: plan_run(compose(list(ctx.args)), fetch=server_command))
    if plan_file:
        import json

        from asyncrl.plan_file import plan_record

        typer.echo(json.dumps(plan_record(plan), indent=2))
        return
    if server_command:
        from asyncrl.launch import shell_line
        from asyncrl.plan.assemble import placed_for_printing, sized_for_printing
        from asyncrl.serving.choice import printable_server_commands

        plan, placing = _checked(lambda: placed_for_printing(plan))
        plan, sizing = _checked(lambda: sized_for_printing(plan))
        commands, warnings = _checked(lambda: printable_server_commands(plan))
        for warning in [*warnings, sizing, placing]:
            if warning is not None:
                typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
        typer.echo("".join(shell_line(command.argv, command.env) for command in commands), nl=False)
        return
    typer.echo(to_yaml(plan.config), nl=False)


def _print_run(run_dir: Path, overrides: list[str], *, plan_file: bool, server_command: bool) -> None:
    """`asyncrl config --run-dir DIR`: what that run decided, read from its plan.json (checked against this asyncrl's
    schema), not planned again: its config as YAML, its plan (--plan) or the commands it launched its servers with."""
    import json

    from asyncrl.config.compose import to_yaml
    from asyncrl.config.errors import ConfigError
    from asyncrl.launch import shell_line
    from asyncrl.plan_file import plan_record, read_plan

    def read():  # type: ignore[no-untyped-def]
        if overrides:
            raise ConfigError(f"--run-dir {run_dir} prints what that run decided: drop the overrides {overrides}")
        return read_plan(run_dir)

    plan = _checked(read)
    if plan_file:
        typer.echo(json.dumps(plan_record(plan), indent=2))
    elif server_command:
        if not plan.server_commands:
            typer.secho(f"{run_dir}'s plan.json holds no server command: the run attached to its server "
                        "(server.launch=false), or stopped before its vLLM was given its share", err=True)  # fmt: skip
            raise typer.Exit(1)
        typer.echo("".join(shell_line(c.argv, c.env) for c in plan.server_commands), nl=False)
    else:
        typer.echo(to_yaml(plan.config), nl=False)


@app.command(cls=_Command)
def recipes() -> None:
    """List the recipes selectable with +recipe=NAME."""
    from rich.console import Console
    from rich.table import Table

    from asyncrl.recipes import list_recipes

    table = Table(title="asyncrl recipes (use: asyncrl train +recipe=NAME)")
    table.add_column("recipe", style="bold cyan")
    table.add_column("description")
    for recipe in list_recipes():
        table.add_row(recipe.name, recipe.description)
    Console().print(table)


@app.command(cls=_Command, context_settings=_EXTRA, options_metavar="[OPTIONS] [RUN_DIR] [OVERRIDES]...")
def serve(ctx: typer.Context) -> None:
    """Run the generation server alone in the foreground. Arguments: a run directory (its final model, else its
    newest checkpoint, with the run's overrides) or a model directory, if any, then Hydra overrides as for train:
    [bold]asyncrl serve runs/2026-01-31_12-00-00 server.port=8001[/bold]"""
    from asyncrl.launch import check_serve, serve_forever, serve_plan
    from asyncrl.trainer.exits import EXPECTED_ERRORS

    plan = _checked(lambda: serve_plan(list(ctx.args)))
    config = plan.config
    note = _checked(lambda: _check_before_loading(plan))
    if note:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    _checked(lambda: check_serve(config))
    try:
        serve_forever(plan)
    except EXPECTED_ERRORS as exc:
        typer.secho(f"error ({type(exc).__name__}): {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from exc


@app.command(cls=_Command)
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory or a multirun sweep.")],
) -> None:
    """Write plots and one self-contained HTML page into RUN_DIR/report/ and print the page's path."""
    from asyncrl.report import write_report

    try:
        typer.echo(str(write_report(run_dir)))
    except (FileNotFoundError, ValueError) as exc:
        typer.secho(f"report error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


class ExportDtype(StrEnum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


@app.command(cls=_Command)
def export(
    source: Annotated[Path, typer.Argument(help="Run dir (its model/, else newest checkpoint), checkpoint or model.")],
    out: Annotated[Path, typer.Argument(help="The directory to write the standalone model to.")],
    dtype: Annotated[ExportDtype, typer.Option(help="Dtype of the saved weights.")] = ExportDtype.bfloat16,
    base: Annotated[str | None, typer.Option(help="Adapter's base (path or Hub id) if not its saved one.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT.")] = False,
) -> None:
    """Save a model any library loads: a LoRA adapter merged into its base, or a full model in DTYPE."""
    from rich.console import Console

    from asyncrl.export import ExportError
    from asyncrl.export import export as export_model

    console = Console()
    try:
        with console.status(f"exporting {source} ..."):
            done = export_model(source, out, dtype.value, base, overwrite)
    except ExportError as exc:
        typer.secho(f"export error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
    kind = f"LoRA adapter merged into [bold]{done.base}[/bold]" if done.base else "full model"
    console.print(f"read [cyan]{done.model_dir}[/cyan] ({kind})", soft_wrap=True)
    written = f"{done.num_parameters:,} parameters in {done.dtype}"
    console.print(f"wrote [bold green]{done.out}[/bold green]: {written}", soft_wrap=True)


def _checked(build):  # type: ignore[no-untyped-def]
    """Turn configuration errors into one red line and exit code 2, before any expensive work."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from asyncrl.config.messages import config_error_line
    from asyncrl.trainer.exits import CONFIG_ERRORS

    try:
        return build()
    except (*CONFIG_ERRORS, HydraException, OmegaConfBaseException) as exc:
        typer.secho(f"config error: {config_error_line(exc)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


if __name__ == "__main__":
    app()
