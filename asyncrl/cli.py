"""The `asyncrl` command: Typer owns subcommands and help; Hydra owns composition, overrides and sweeps.

Heavy imports (torch, transformers, hydra) happen inside the commands so `asyncrl --help` stays fast.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from asyncrl import __version__

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

app = typer.Typer(
    name="asyncrl",
    help="Asynchronous GRPO: generation and training overlap, weights move to the server as training goes.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

_EXTRA = {"allow_extra_args": True, "ignore_unknown_options": True}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"asyncrl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """asyncrl: asynchronous GRPO trainer for language models."""


@app.command(context_settings=_EXTRA)
def train(
    ctx: typer.Context,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Sweep: one job per combination of values."),
    cfg: str = typer.Option(None, "--cfg", "-c", help="Print the composed config (job|hydra|all) and exit."),
) -> None:
    """Train. Extra arguments are Hydra overrides: [bold]+recipe=deepmath trainer.learning_rate=3e-6[/bold]"""
    from asyncrl.launch import run_hydra

    _checked(lambda: _preflight(list(ctx.args), multirun, validate=cfg is None))
    run_hydra(list(ctx.args), multirun=multirun, cfg=cfg)


def _preflight(overrides: list[str], multirun: bool, validate: bool) -> None:
    """Compose (each value of a sweep), validate, and check the run directory, before Hydra makes it: Hydra
    reports these over many lines or as a traceback, and would create the run directory first."""
    from omegaconf import open_dict

    from asyncrl.config.compose import compose
    from asyncrl.config.messages import check_run_dir
    from asyncrl.plan.assemble import plan_run

    notes = set()
    for variant in _sweep_variants(overrides) if multirun else [overrides]:
        composed = compose(variant, return_hydra_config=True)
        with open_dict(composed):
            hydra = composed.pop("hydra")
        key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
        check_run_dir(str(hydra.sweep.dir if multirun else hydra.run.dir), key)
        if validate:
            notes.add(_check_before_loading(plan_run(composed).config))
    for note in notes - {None}:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)


def _check_before_loading(config: Config) -> str | None:
    """This machine can run the server asked for and has, or can download, every Hub id the run reads: checked
    before the job loads anything, which would otherwise fail late (vLLM's launch, after the data and tokenizer) or
    slowly (a load waiting through the Hub's retries, then a traceback). Returns a note when the Hub does not answer
    and the cache serves."""
    from asyncrl.hub import check_hub_sources
    from asyncrl.server.command import resolve_backend

    if config.server.launch and resolve_backend(config) == "vllm":
        from asyncrl.server.vllm import check_launchable

        check_launchable(config)
    return check_hub_sources(config)


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


@app.command(context_settings=_EXTRA)
def config(
    ctx: typer.Context,
    server_command: bool = typer.Option(
        False, "--server-command", help="Print the server command line instead (one per server.replicas)."
    ),
) -> None:
    """Print the composed, validated config as YAML (same overrides as train)."""
    from asyncrl.config.compose import compose, to_yaml
    from asyncrl.plan.assemble import plan_run

    composed = _checked(lambda: plan_run(compose(list(ctx.args))).config)
    if server_command:
        from asyncrl.launch import shell_line
        from asyncrl.server.choice import printable_server_commands

        commands, warnings = _checked(lambda: printable_server_commands(composed))
        for warning in warnings:
            typer.secho(f"warning: {warning}", fg=typer.colors.YELLOW, err=True)
        typer.echo("".join(shell_line(command.argv, command.env) for command in commands), nl=False)
        return
    typer.echo(to_yaml(composed), nl=False)


@app.command()
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


@app.command(context_settings=_EXTRA)
def serve(ctx: typer.Context) -> None:
    """Run the generation server alone in the foreground (same config groups as train)."""
    from asyncrl.config.compose import compose
    from asyncrl.launch import EXPECTED_ERRORS, serve_forever
    from asyncrl.plan.assemble import plan_run

    config = _checked(lambda: plan_run(compose(list(ctx.args))).config)
    note = _checked(lambda: _check_before_loading(config))
    if note:
        typer.secho(f"note: {note}", fg=typer.colors.YELLOW, err=True)
    try:
        serve_forever(config)
    except EXPECTED_ERRORS as exc:
        typer.secho(f"error ({type(exc).__name__}): {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from exc


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(exists=True, file_okay=False, help="A run directory or a multirun sweep.")],
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


@app.command()
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

    from asyncrl.config.errors import ConfigError
    from asyncrl.config.messages import config_error_line
    from asyncrl.data import DatasetError

    try:
        return build()
    except (ConfigError, DatasetError, HydraException, OmegaConfBaseException) as exc:
        typer.secho(f"config error: {config_error_line(exc)}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc


if __name__ == "__main__":
    app()
