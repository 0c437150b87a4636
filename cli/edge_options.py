"""What every command that runs an edge worker shares (`edge generate`, `edge serve`, `demo`): the
EdgeConfig flags, the config they make, and starting the worker."""
from __future__ import annotations

from collections.abc import Iterable

from ..common.config import load_config
from ..edge.config import EdgeConfig
from .flags import add_config_flags, config_overrides


def add_edge_options(parser, exclude: Iterable[str] = ()) -> None:
    """--config and one flag per EdgeConfig field but those in `exclude` (shared by `edge generate`,
    `edge serve` and `demo`)."""
    parser.add_argument("--config", help="YAML file of EdgeConfig keys; flags override it")
    add_config_flags(parser.add_argument_group("edge settings (EdgeConfig keys; flags override --config)"),
                     EdgeConfig, exclude)


def edge_config(args, **defaults):
    """EdgeConfig from its defaults, then --config, then `defaults` (a command's own, such as the demo's)
    and the flags."""
    return load_config(EdgeConfig, args.config, {**defaults, **config_overrides(args, EdgeConfig)})


def build_worker(config, background: bool = False, require_cloud: bool = True):
    """Connect, load the drafter (on a background thread if `background`: generations start with the
    cloud decoding alone meanwhile), and check the pair matches. With --cloud-only, where the drafter's
    tokenizer is readable without it (edge/textcodec.py), no drafter is loaded at all: nothing drafts."""
    from ..edge.client import VerifierClient
    from ..edge.startup import DrafterLoad, fast_codec
    from ..edge.worker import EdgeWorker

    codec = fast_codec(config.model) if background or config.policy.cloud_only else None
    if codec is None:  # the worker needs the loaded drafter's tokenizer from the start
        load = DrafterLoad.start(config.model, background=False)
    elif config.policy.cloud_only:
        load = DrafterLoad.skipped("--cloud-only loads no drafter: nothing can generate while the cloud is away")
    else:
        load = DrafterLoad()  # started once the cloud has agreed to the tokenizer: a wrong pair loads nothing
    client = VerifierClient(config.link.cloud, config.link.timeout_s, config.cloud_access())
    try:
        worker = EdgeWorker(load, client, config, codec=codec, require_cloud=require_cloud)
    except BaseException:
        client.close()
        raise
    if codec is not None and not config.policy.cloud_only:
        load.begin(config.model, background=background)
    return worker
