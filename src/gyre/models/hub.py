"""``model.path`` as users write it: a local folder, or a Hugging Face hub id.

A hub id (``org/name``) that is not a local folder is resolved through the Hugging Face hub cache
with ``huggingface_hub.snapshot_download``: with ``HF_HUB_OFFLINE=1`` only the cache is read; online
it downloads as transformers would. Everything after this point sees a plain local folder, so Ray
workers, the server and checkpoints never resolve the id again.
"""

from __future__ import annotations

import re
from pathlib import Path

from gyre.errors import InputError

# What the hub accepts as a repo id: one optional namespace and a name of letters, digits, - _ .
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` has the shape of a hub repo id (``org/name``) rather than a file path."""
    return "/" in path and bool(_HUB_ID.match(path)) and not path.startswith((".", "~"))


def resolve_model_path(path: str | Path, key: str = "model.path") -> Path:
    """The local folder of ``path``: itself when it exists on disk, else the hub cache snapshot
    of the hub id it names (downloaded when online). A missing id is an :class:`InputError`
    naming it and saying whether the lookup was offline."""
    text = str(path)
    local = Path(text).expanduser()
    if local.exists() or not looks_like_hub_id(text):
        return local
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise InputError(f"{key} '{text}' is not a local folder") from None
    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        folder = snapshot_download(repo_id=text, local_files_only=offline)
    except LocalEntryNotFoundError:
        where = f"the hub cache {constants.HF_HUB_CACHE}"
        if offline:
            raise InputError(
                f"{key} '{text}': not a local folder, and not in {where} "
                "(HF_HUB_OFFLINE=1, so nothing was downloaded)"
            ) from None
        raise InputError(
            f"{key} '{text}': not a local folder, not in {where}, and the hub could not be "
            "reached to download it"
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"{key} '{text}': not a local folder, and the hub says: {first}") from None
    return Path(folder)
