"""An edge beyond loopback with no invoke key refuses to start unless the operator opts in.

A missing or misspelt key Secret must not serve every route to whoever reaches the port.
"""

from __future__ import annotations

import asyncio

import pytest

from ember.edge.auth import ApiKeys, check_exposure
from ember.edge.edge import EmberEdge
from ember.errors import ConfigError

KEY = "invoke-0123456789abcdef"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7"])
def test_no_key_beyond_loopback_is_refused_naming_the_fix(host: str) -> None:
    with pytest.raises(ConfigError, match="EMBER_ALLOW_UNAUTHENTICATED=1"):
        check_exposure(host, ApiKeys([]))
    # Admin keys alone leave invoke routes open: still refused.
    with pytest.raises(ConfigError, match="EMBER_API_KEYS"):
        check_exposure(host, ApiKeys([], ["admin-0123456789abcdef"]))


@pytest.mark.parametrize(("host", "keys"), [
    ("127.0.0.1", ApiKeys([])), ("::1", ApiKeys([])),
    ("0.0.0.0", ApiKeys([KEY])),
    ("0.0.0.0", ApiKeys.from_env({"EMBER_ALLOW_UNAUTHENTICATED": "1"})),
])
def test_loopback_a_key_or_the_named_opt_in_may_listen(host: str, keys: ApiKeys) -> None:
    check_exposure(host, keys)


class _Unstarted(EmberEdge):
    def __del__(self) -> None:  # type: ignore[override]
        """Nothing to stop: the edge never started."""


def test_the_edge_itself_refuses_at_start_before_it_listens() -> None:
    # The edge checks on its own: a manifest or a caller that skips `ember run` is refused too.
    edge = object.__new__(_Unstarted)
    state_args = {"app_name": "open", "routes": [], "options": {}, "handles": {},
                  "timeouts": {}, "keys": ApiKeys([])}
    with pytest.raises(ConfigError, match=r"refusing to listen on 0\.0\.0\.0"):
        asyncio.run(EmberEdge.__init__(edge, "0.0.0.0", 1, state_args))
