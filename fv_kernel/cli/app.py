"""Root of the ``fv`` CLI. Sub-apps live in their own modules and are added here."""

from __future__ import annotations

import typer

from fv_kernel import API_VERSION, __version__
from fv_kernel.cli.cards_cmd import cards_app
from fv_kernel.cli.generate_cmd import generate
from fv_kernel.cli.plugins_cmd import plugins_app
from fv_kernel.cli.serve_cmd import serve

app = typer.Typer(
    name="fv",
    help="fv: a model-native runtime for video generation.",
    no_args_is_help=True,
)
app.add_typer(plugins_app, name="plugins")
app.add_typer(cards_app, name="cards")
app.command("generate")(generate)
app.command("serve")(serve)


@app.command("version")
def version() -> None:
    """Print the kernel version and the plugin API version."""
    typer.echo(f"fv-kernel {__version__} (plugin API {API_VERSION})")


def main() -> None:
    """Console-script entry point (``fv``)."""
    app()


if __name__ == "__main__":
    main()
