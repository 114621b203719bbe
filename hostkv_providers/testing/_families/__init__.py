"""The conformance suite by family: one mixin class per family of rules, each a
:class:`._base.SuiteBase`; :class:`hostkv_providers.testing.ProviderTests` combines them all
(fsspec's ``tests/abstract`` is the model)."""
