"""The main job and the Hugging Face Hub: a model or dataset named by a Hub id while the Hub cannot be reached is
refused at once (one line, exit code 2), instead of after the loaders' retries (about 30 s per file, then the same
failure). With ``HF_HUB_OFFLINE=1`` the loaders read the local cache and fail fast on their own, so nothing is
probed."""

from __future__ import annotations

from .usage import UsageError, first_line

__all__ = ["PROBE_SECONDS", "check_hub_reachable", "hub_unreachable"]

PROBE_SECONDS = 5.0  # one HEAD request to the Hub's endpoint: a reachable Hub answers well within it


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached now (the probe's error, first line), or None: it answered, or ``HF_HUB_OFFLINE``
    is set (the loaders then use the cache alone). One HEAD request through huggingface_hub's own session (its
    proxies and endpoint), without retries."""
    import huggingface_hub
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        huggingface_hub.get_session().head(constants.ENDPOINT, timeout=PROBE_SECONDS)
    except Exception as error:  # httpx's and the OS's network errors alike
        return f"{constants.ENDPOINT} cannot be reached: {first_line(error)}"
    return None


def check_hub_reachable(flag: str, spec: str) -> None:
    """Raises UsageError when ``spec``, a Hub id given as ``flag``, would be fetched from a Hub that cannot be
    reached, naming the fixes: a local path, or ``HF_HUB_OFFLINE=1`` to read the local cache."""
    why = hub_unreachable()
    if why is not None:
        raise UsageError(
            f"{flag} {spec!r} is not a local path, and the Hugging Face Hub {why}: pass a local path, or set "
            "HF_HUB_OFFLINE=1 to load it from the Hugging Face cache"
        )
