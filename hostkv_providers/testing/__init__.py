"""The conformance suite every provider subclasses, shipped in the wheel.

``ProviderTests`` is a pytest test-class base; ``ProviderStateMachine`` the hypothesis model it
runs; the page helpers compute a page's expected bytes from its key in any process.

Importing this package needs pytest; the state machine additionally needs hypothesis and is
imported lazily, so the pytest plugin (loaded in every pytest session where the package is
installed) works without hypothesis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hostkv_providers.testing._batch_chain import BatchChainTests
from hostkv_providers.testing._families._anchors import AnchorTests
from hostkv_providers.testing._families._base import ProviderFactory, SuiteBase
from hostkv_providers.testing._families._basics import BasicTests
from hostkv_providers.testing._families._checksums import ChecksumTests
from hostkv_providers.testing._families._eviction import EvictionTests
from hostkv_providers.testing._families._leases import LeaseTests
from hostkv_providers.testing._families._lifecycle import LifecycleTests
from hostkv_providers.testing._families._misuse import MisuseTests
from hostkv_providers.testing._families._model import StatefulTests
from hostkv_providers.testing._families._persistence import PersistenceTests
from hostkv_providers.testing._families._powers import CapabilityTests
from hostkv_providers.testing._families._retain import RetainTests
from hostkv_providers.testing._families._writes import WriteTests
from hostkv_providers.testing._gc import cache_settled, cycles_left_by
from hostkv_providers.testing._hostile import HostileInputTests
from hostkv_providers.testing._pages import (
    anchor_bytes,
    chain,
    engine_planes,
    key_of,
    page_bytes,
    put_chain,
    put_page,
)
from hostkv_providers.testing._suite import ProviderTests

if TYPE_CHECKING:
    from hostkv_providers.testing._stateful import ProviderStateMachine, run_provider_state_machine

__all__ = [
    "AnchorTests",
    "BasicTests",
    "BatchChainTests",
    "CapabilityTests",
    "ChecksumTests",
    "EvictionTests",
    "HostileInputTests",
    "LeaseTests",
    "LifecycleTests",
    "MisuseTests",
    "PersistenceTests",
    "ProviderFactory",
    "ProviderStateMachine",
    "ProviderTests",
    "RetainTests",
    "StatefulTests",
    "SuiteBase",
    "WriteTests",
    "anchor_bytes",
    "cache_settled",
    "chain",
    "cycles_left_by",
    "key_of",
    "engine_planes",
    "page_bytes",
    "put_chain",
    "put_page",
    "run_provider_state_machine",
]


def __getattr__(name: str) -> Any:
    if name in ("ProviderStateMachine", "run_provider_state_machine"):
        from hostkv_providers.testing import _stateful
        return getattr(_stateful, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
