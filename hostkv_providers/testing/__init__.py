"""The conformance suite every provider subclasses, shipped in the wheel.

``ProviderTests`` is a pytest test-class base; ``ProviderStateMachine`` the hypothesis model it
runs; the page helpers compute a page's expected bytes from its key in any process.

Importing this package needs pytest; the state machine additionally needs hypothesis and is
imported lazily, so the pytest plugin (loaded in every pytest session where the package is
installed) works without hypothesis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hostkv_providers.testing._pages import anchor_bytes, chain, key_of, page_bytes, put_chain, put_page
from hostkv_providers.testing._suite import (
    AnchorTests,
    BasicTests,
    CapabilityTests,
    ChecksumTests,
    EvictionTests,
    LeaseTests,
    LifecycleTests,
    MisuseTests,
    PersistenceTests,
    ProviderFactory,
    ProviderTests,
    StatefulTests,
    SuiteBase,
    WriteTests,
)

if TYPE_CHECKING:
    from hostkv_providers.testing._stateful import ProviderStateMachine, run_provider_state_machine

__all__ = [
    "AnchorTests",
    "BasicTests",
    "CapabilityTests",
    "ChecksumTests",
    "EvictionTests",
    "LeaseTests",
    "LifecycleTests",
    "MisuseTests",
    "PersistenceTests",
    "ProviderFactory",
    "ProviderStateMachine",
    "ProviderTests",
    "StatefulTests",
    "SuiteBase",
    "WriteTests",
    "anchor_bytes",
    "chain",
    "key_of",
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
