"""``studies plugins``: what the registries hold, by kind (losses, data sets, models): every
entry with its parameters (a built-in model's: those that apply to it, `FIELD_APPLIES`), each
installed plugin with its distribution, and every refused plugin with the reason. Fits 80
columns.

The plugins' code is imported (as the trainer would, ``setvalued.registry.load_factory``) so
that a constructor that does not take its declared parameters shows here, not on a worker.
"""

from __future__ import annotations

import argparse
import textwrap

WIDTH = 80
TITLES = {"loss": "losses", "dataset": "data sets", "model": "models"}
SECTION = {"loss": "loss", "dataset": "data", "model": "model"}


def _wrap(text: str, indent: int, hang: int = 2) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + hang), break_on_hyphens=False
    ) or [" " * indent]


def _code_problem(kind: str, name: str) -> str | None:
    """Why a registered plugin's code cannot be used, or None (it imports and fits its declaration)."""
    from setvalued import registry

    try:
        if kind == "loss":
            from setvalued.losses import loss_parameters

            loss_parameters(name)
        else:
            registry.load_factory(kind, name)
    except registry.PluginError as error:
        return str(error)
    return None


def _parameters(kind: str, item) -> dict:
    """An entry's parameters as a study sets them: without ``name`` (the entry itself) and, for
    a built-in, without the fields that have no effect on it (`setvalued.config.FIELD_APPLIES`:
    no DenseNet depth for the MLP)."""
    from setvalued.config import FIELD_APPLIES

    section = SECTION[kind]
    out = {}
    for key, param in item.parameters.items():
        applies = FIELD_APPLIES.get((section, key)) if item.builtin else None
        if key == "name" or (applies is not None and not applies({"name": item.name})):
            continue
        out[key] = param
    return out


def listing(check_code: bool = True) -> tuple[list[str], int]:
    """The lines of ``studies plugins`` and the number of refused plugins."""
    from setvalued import registry

    lines: list[str] = []
    refused = 0
    for kind in registry.KINDS:
        items = registry.entries(kind)
        builtin = [name for name, item in items.items() if item.builtin]
        plugins = [item for item in items.values() if not item.builtin]
        rejected = [r for r in registry.refusals() if r.kind == kind]
        lines.append(
            f"{TITLES[kind]} ({SECTION[kind]}.name): {len(builtin)} built-in, {len(plugins)} "
            f"plugin(s)" + (f", {len(rejected)} refused" if rejected else "")
        )
        lines += _wrap(
            "built-in: " + ", ".join(builtin) + (" and any timm architecture" if kind == "model" else ""), 2, 4
        )
        for item in [items[name] for name in builtin] + plugins:
            lines += _wrap(f"{item.name}  [{'built-in' if item.builtin else item.origin}]", 2, 4)
            if item.doc:
                lines += _wrap(item.doc, 4)
            problem = _code_problem(kind, item.name) if check_code and not item.builtin else None
            if problem:
                refused += 1
                lines += _wrap(f"REFUSED: {problem}", 4)
                continue
            parameters = _parameters(kind, item)
            for key, param in parameters.items():
                default = "required" if param.required else f"default {param.default!r}"
                lines += _wrap(
                    f"{SECTION[kind]}.{key}: {param.describe()}; {default}" + (f"; {param.doc}" if param.doc else ""),
                    4,
                    4,
                )
            if not parameters:
                lines += _wrap("(no parameters)", 4)
        for refusal in rejected:
            refused += 1
            lines += _wrap(
                f"REFUSED {refusal.name}  [{refusal.distribution} {refusal.version}, entry point "
                f"{refusal.entry_point}]: {refusal.reason}",
                2,
                4,
            )
        lines.append("")
    return lines[:-1], refused


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-import",
        dest="check_code",
        action="store_false",
        help="read the declarations only: do not import the plugins' code (torch) to check it against them",
    )


def run(args: argparse.Namespace) -> int:
    """Print the listing; exit 1 when a plugin is refused."""
    lines, refused = listing(args.check_code)
    print("\n".join(lines))
    return 1 if refused else 0
