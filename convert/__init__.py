"""Conversions between formats through qconv's canonical representation (later issues)."""
