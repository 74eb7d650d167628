"""Every option of TieredConfig is documented once (tiered.options.option_docs), and the README's
table and the class's docstring are what that one source makes."""

import dataclasses
import os

import tiered
from tiered.options import option_docs
from tiered.options.config import TieredConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_option_is_documented_exactly_once():
    fields = [f.name for f in dataclasses.fields(TieredConfig) if f.name != "_"]
    names = option_docs.documented()
    assert sorted(names) == sorted(fields)  # none missing, none unknown, none twice


def test_the_readme_table_is_the_generated_one():
    text = open(os.path.join(ROOT, "README.md")).read()
    between = text.split(option_docs.BEGIN, 1)[1].split(option_docs.END, 1)[0]
    assert between.strip() == option_docs.table(TieredConfig), (
        "README's option table is stale: python -c \"import tiered; from tiered.options import "
        "option_docs as o; o.write_readme(tiered.TieredConfig)\"")


def test_help_lists_every_option_with_its_default():
    doc = tiered.TieredConfig.__doc__
    for name in option_docs.documented():
        assert f"{name}=" in doc, name
