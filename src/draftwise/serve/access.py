"""Who may use a server: the API key's sources and the warning for a server open to a network, without the
server's extra installed (the check itself is :class:`~draftwise.serve.app.APIKeyCheck`)."""

from __future__ import annotations

#: The environment variable an API key is read from when no flag gives one (vLLM's name for it).
API_KEY_VARIABLE = "VLLM_API_KEY"
#: Hosts only this machine can reach.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """What to warn an operator of who binds ``host`` without an API key (``None``: nothing to warn of)."""
    if api_key is not None or host in LOOPBACK_HOSTS or host.startswith("127."):
        return None
    return (f"serving on {host} without an API key: anyone who can reach this port can use the server "
            f"(give --api-key, --api-key-file or {API_KEY_VARIABLE})")
