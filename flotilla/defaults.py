"""Every default the SDK uses, in one place.

A value given to ``Client``/``AsyncClient`` wins over its environment
variable, which wins over the constant here (see ``flotilla.config``).
"""

from __future__ import annotations

# Where the server is and who we are.
BASE_URL = "http://127.0.0.1:8000"
ENV_BASE_URL = "FLOTILLA_BASE_URL"
ENV_API_KEY = "FLOTILLA_API_KEY"
SESSION_HEADER = "X-Flotilla-Session"  # the prefix-aware router keeps a session on one replica
PREVIOUS_RESPONSE_HEADER = "X-Flotilla-Previous-Response"  # routes a continuation to the replica holding it
MODEL_HEADER = "X-Flotilla-Model"  # the request's model: the router prefers replicas with that LoRA adapter loaded

# Timeouts (seconds). ``TIMEOUT_S`` bounds a whole call, streams included.
CONNECT_TIMEOUT_S = 10.0
TIMEOUT_S = 600.0

# Retries: exponential backoff with jitter, capped; a server's Retry-After is
# honoured up to RETRY_AFTER_MAX_S.
MAX_RETRIES = 2
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 8.0
RETRY_AFTER_MAX_S = 60.0
RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})

# Client-side concurrency.
BATCH_CONCURRENCY = 16
MAX_CONNECTIONS = 256  # aiohttp's pool; batch concurrency is bounded separately

USER_AGENT = "flotilla-python"
