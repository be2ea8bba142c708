"""Helpers shared by the test tiers: clusters, waiting, fault injection and fakes."""
