"""The conformance suite every provider subclasses, shipped in the wheel.

``ProviderTests`` is a pytest test-class base; ``ProviderStateMachine`` the hypothesis model it
runs; the page helpers compute a page's expected bytes from its key in any process.
"""

from ._pages import anchor_bytes, chain, key_of, page_bytes, put_chain, put_page
from ._stateful import ProviderStateMachine, run_provider_state_machine
from ._suite import ProviderFactory, ProviderTests

__all__ = [
    "ProviderFactory",
    "ProviderStateMachine",
    "ProviderTests",
    "anchor_bytes",
    "chain",
    "key_of",
    "page_bytes",
    "put_chain",
    "put_page",
    "run_provider_state_machine",
]
