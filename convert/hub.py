"""Upload an exported folder to the Hugging Face Hub (huggingface_hub's create_repo + upload_folder).

The token comes from where huggingface_hub looks (HF_TOKEN, the saved login);
it is never printed or logged here.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from zoo.errors import UserError


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection-error base classes of whichever HTTP client huggingface_hub uses."""
    errors: list[type[BaseException]] = [OSError]
    for mod, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            errors.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def check_repo_id(repo_id: str) -> None:
    """A malformed repo id is a UserError before any work is done."""
    from huggingface_hub.utils import validate_repo_id

    if repo_id.count("/") != 1:
        raise UserError(f"--push-to-hub {repo_id!r}: write it as USER/REPO (or ORG/REPO)")
    try:
        validate_repo_id(repo_id)
    except ValueError as e:
        raise UserError(f"--push-to-hub {repo_id!r} is not a valid repo id ({str(e).splitlines()[0]})") from None


def push_folder(folder: Path, repo_id: str, private: bool = False, revision: str | None = None) -> str:
    """Create ``repo_id`` if needed (and branch ``revision``), upload ``folder``; returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        # None (not False) keeps an organization's "private by default" setting.
        api.create_repo(repo_id, private=private or None, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, revision=revision,
            commit_message="Upload model exported with lmzoo",
        )
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        hint = " (log in with `hf auth login` or set HF_TOKEN)" if status in (401, 403) else ""
        raise UserError(f"push to {repo_id} failed: HTTP {status}{hint}") from None
    except _network_errors() as e:
        raise UserError(f"push to {repo_id} failed: cannot reach the Hub ({type(e).__name__}); check HF_ENDPOINT and the network") from None
    except ValueError as e:
        raise UserError(f"push to {repo_id} failed: {str(e).splitlines()[0]}") from None
    return str(getattr(info, "commit_url", info))


def destination(repo_id: str, revision: str | None) -> str:
    """Human-readable URL of where an upload goes."""
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo_id}/tree/{revision or 'main'}"
