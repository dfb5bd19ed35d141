"""qconv's version: one literal, read by the package (__version__), pyproject.toml (setuptools' dynamic
version) and the model card (convert/card.py), which cannot import the package it is part of."""

VERSION = "0.1.0"
