"""Upload an exported folder to the Hugging Face Hub (huggingface_hub's create_repo + upload_folder).

The token comes from where huggingface_hub looks (HF_TOKEN, the saved login);
it is never printed or logged here.
"""

from __future__ import annotations

from pathlib import Path

from zoo.errors import UserError


def push_folder(folder: Path, repo_id: str, private: bool = False, revision: str | None = None) -> str:
    """Create ``repo_id`` if needed (and branch ``revision``), upload ``folder``; returns the commit URL."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
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
    except OSError as e:
        raise UserError(f"push to {repo_id} failed: cannot reach the Hub ({type(e).__name__})") from None
    return str(getattr(info, "commit_url", info))


def destination(repo_id: str, revision: str | None) -> str:
    """Human-readable URL of where an upload goes."""
    from huggingface_hub import constants

    return f"{constants.ENDPOINT}/{repo_id}/tree/{revision or 'main'}"
