"""Makes ``backend="ringddp"`` known to torch.distributed in every process, without an import.

torch loads the ``torch.backends`` entry points of installed packages at the end of ``import
torch`` (unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``); ringddp's points here. So an unmodified
torch program — under ``torchrun`` too — can call ``init_process_group(backend="ringddp")``.
This only registers the name: the backend itself (``collectives.torch_backend``) is imported
when torch first creates a ringddp group, so ``import torch`` stays cheap and never fails
because of ringddp (a failure here is logged, not raised).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _create(*args, **kwargs):
    from collectives import torch_backend  # importing collectives registers the real creator too

    return torch_backend.create(*args, **kwargs)


def register() -> None:
    """The entry point: register the name ``ringddp`` with a creator that loads the backend."""
    try:
        import torch.distributed as dist

        if dist.is_available() and "ringddp" not in dist.Backend.backend_list:
            dist.Backend.register_backend("ringddp", _create, extended_api=True, devices=["cpu"])
    except Exception as exc:  # noqa: BLE001 - must never break `import torch`
        log.warning("ringddp: could not register the torch.distributed backend: %s", exc)
