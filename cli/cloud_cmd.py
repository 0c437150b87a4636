"""`hybridspec cloud serve`: load the target and serve the Verifier over gRPC."""
from __future__ import annotations

import asyncio
import logging
import sys


def register(sub) -> None:
    """Add the `cloud` command group."""
    cloud = sub.add_parser("cloud", help="run the cloud verifier")
    csub = cloud.add_subparsers(dest="cloud_command", required=True, metavar="ACTION")
    serve = csub.add_parser("serve", help="serve the target model until SIGINT/SIGTERM")
    serve.add_argument("--config", help="YAML file of ServeConfig keys (see deploy/)")
    serve.add_argument("--target", help="model directory, .gguf file or cached hub id")
    serve.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default 50051; 0 = any free port)")
    serve.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    serve.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    serve.add_argument("--torch-threads", type=int, help="CPU intra-op threads (0 = torch default)")
    serve.add_argument("--max-sessions", type=int, help="sessions held at once")
    serve.add_argument("--max-context", type=int, help="committed + draft tokens per session")
    serve.add_argument("--max-draft", type=int, help="longest draft block accepted")
    serve.set_defaults(run=run_serve)


def run_serve(args) -> int:
    """Load the model, then serve; prints one 'serving' line once ready."""
    import torch

    from ..cloud.config import ServeConfig
    from ..cloud.server import serve_forever
    from ..cloud.verifier import Verifier
    from ..common.config import load_config
    from ..common.models import load_model
    from .models_cmd import resolve

    overrides = {"target": args.target, "host": args.host, "port": args.port, "device": args.device,
                 "dtype": args.dtype, "torch_threads": args.torch_threads, "max_sessions": args.max_sessions,
                 "max_context": args.max_context, "max_draft": args.max_draft}
    config = load_config(ServeConfig, args.config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    target = load_model(resolve(config.target, "target"), config.device, config.dtype)
    core = Verifier(target, config.limits)

    def ready(port: int) -> None:
        print(f"hybridspec verifier serving {target.name} on {config.host}:{port} ({target.device})", flush=True)

    asyncio.run(serve_forever(core, config.host, config.port, config.grace_s, ready))
    print("hybridspec verifier stopped", file=sys.stderr)
    return 0
