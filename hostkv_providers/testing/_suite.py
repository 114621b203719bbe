"""``ProviderTests``: the conformance suite every provider's test class subclasses.

Usage (in a provider's test module)::

    from hostkv_providers.testing import ProviderTests

    class TestMyConformance(ProviderTests):
        supports_reopen = True

        def make_provider(self, tmp_path, budget_bytes):
            return MyProvider(tmp_path / "store", budget_bytes=budget_bytes)

        def reopen(self, provider):
            provider.close()
            return MyProvider(...same store...)

        def backdoor_read(self, provider, key):       # required for persistent providers
            ...
        def backdoor_corrupt(self, provider, key):    # required for persistent providers
            ...

Every test checks one rule of the :class:`~hostkv_providers.Provider` docstring or of DESIGN.md
("Invariants every provider keeps").  The tests live by family in ``testing/_families/`` (one
mixin each: basics, eviction, leases, writes, anchors, misuse, lifecycle, persistence, optional
powers, checksums, the stateful model) and the hostile-input tests (``testing/_hostile.py``:
every public method with wrong types and sizes, closed, forked, racing); ``ProviderTests`` is
all of them.  Tests that need an optional power (``iterate``, ``verify``, ``views``, reopen)
skip, never fail, when the provider lacks it; the backdoors are required for a persistent
provider.  Page contents are a PRNG of the key (:func:`page_bytes`), so a wrong byte
anywhere is caught by recomputation.
"""

from __future__ import annotations

from hostkv_providers.testing._batch_chain import BatchChainTests
from hostkv_providers.testing._families._anchors import AnchorTests
from hostkv_providers.testing._families._base import SuiteBase
from hostkv_providers.testing._families._basics import BasicTests
from hostkv_providers.testing._families._checksums import ChecksumTests
from hostkv_providers.testing._families._eviction import EvictionTests
from hostkv_providers.testing._families._leases import LeaseTests
from hostkv_providers.testing._families._lifecycle import LifecycleTests
from hostkv_providers.testing._families._misuse import MisuseTests
from hostkv_providers.testing._families._model import StatefulTests
from hostkv_providers.testing._families._persistence import PersistenceTests
from hostkv_providers.testing._families._powers import CapabilityTests
from hostkv_providers.testing._families._writes import WriteTests
from hostkv_providers.testing._hostile import HostileInputTests


class ProviderTests(
    BasicTests,
    EvictionTests,
    LeaseTests,
    WriteTests,
    AnchorTests,
    MisuseTests,
    LifecycleTests,
    PersistenceTests,
    CapabilityTests,
    ChecksumTests,
    StatefulTests,
    BatchChainTests,
    HostileInputTests,
    SuiteBase,
):
    """Base class of a provider's conformance tests (not collected itself: no ``Test`` prefix):
    every family.  Subclasses implement :meth:`make_provider` and, for persistent providers, set
    ``supports_reopen = True``, implement :meth:`reopen` and the backdoors
    :meth:`backdoor_read` / :meth:`backdoor_corrupt`, which reach the medium without the
    provider's read path so the suite checks the provider against an independent path."""
