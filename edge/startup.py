"""Starting an edge fast: the drafter loads on a background thread while the cloud already decodes.

Importing torch and transformers and loading a drafter costs seconds on a small CPU, and the first
tokens do not need the drafter: a generation starts cloud-only (edge/generation.py) with the prompt
encoded by the torch-free `TextCodec`, and turns hybrid once `DrafterLoad` is ready. With --cloud-only
nothing drafts, and no drafter is loaded at all (`DrafterLoad.skipped`).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..common.models.embedded import resolve
from ..common.protocol.errors import FailedPrecondition
from .config import DrafterModel
from .textcodec import TextCodec, tokenizer_dir

if TYPE_CHECKING:
    from ..common.models.loading import LoadedModel


class DrafterLoad:
    """The drafter model, and an eagle head's plain fallback drafter, once loaded."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._models: tuple[LoadedModel, LoadedModel | None] | None = None
        self._error: BaseException | None = None
        self._skipped = ""  # why no drafter is loaded at all ("": one is, or will be)

    @classmethod
    def start(cls, model: DrafterModel, background: bool = True) -> DrafterLoad:
        """Load what the config's `model` section names, on a daemon thread if `background`."""
        load = cls()
        load.begin(model, background)
        return load

    def begin(self, model: DrafterModel, background: bool = True) -> None:
        """Start loading a DrafterLoad made empty (`DrafterLoad()`), on a daemon thread if `background`."""
        if background:
            threading.Thread(target=self._run, args=(model,), daemon=True, name="drafter-load").start()
        else:
            self._run(model)

    @classmethod
    def loaded(cls, model: LoadedModel, fallback: LoadedModel | None = None) -> DrafterLoad:
        """Models loaded elsewhere."""
        load = cls()
        load._models = (model, fallback)
        load._done.set()
        return load

    @classmethod
    def skipped(cls, reason: str) -> DrafterLoad:
        """No drafter at all (--cloud-only: nothing drafts): never ready; `get` raises
        FailedPrecondition(reason) instead of waiting."""
        load = cls()
        load._skipped = reason
        return load

    def ready(self) -> bool:
        """True once loading finished (or failed: `get` then raises); never for a skipped drafter."""
        return self._done.is_set()

    def pending(self) -> bool:
        """True while a load is still under way (False once done, and for a skipped drafter)."""
        return not self._skipped and not self._done.is_set()

    def get(self) -> tuple[LoadedModel, LoadedModel | None]:
        """(drafter, fallback), waiting for them; re-raises what loading raised."""
        if self._skipped:
            raise FailedPrecondition(self._skipped)
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._models is not None
        return self._models

    def _run(self, model: DrafterModel) -> None:
        try:
            import torch

            from ..common.models.loading import load_drafter

            if model.torch_threads:
                torch.set_num_threads(model.torch_threads)
            engine = (model.drafter_engine, model.torch_threads)  # torch, or llama.cpp (its threads)
            drafter = load_drafter(resolve(model.drafter, "drafter"), model.device, model.dtype, *engine)
            fallback = None
            if drafter.is_eagle and model.fallback_drafter != "ngram":
                fallback = load_drafter(resolve(model.fallback_drafter, "plain"), model.device, model.dtype, *engine)
            self._models = (drafter, fallback)
        except BaseException as exc:  # noqa: BLE001 — handed to whoever waits for the drafter
            self._error = exc
        finally:
            self._done.set()


def fast_codec(model: DrafterModel) -> TextCodec | None:
    """The drafter's tokenizer without torch, when it lies in a local directory (else None: the
    Hugging Face tokenizer comes with the loaded drafter)."""
    directory = tokenizer_dir(resolve(model.drafter, "drafter"))
    return TextCodec(directory) if directory is not None else None
