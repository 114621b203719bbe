"""Conformance suite for hostkv-providers providers."""
