"""A finding's life, from a failing verdict to the files a maintainer trusts.

judge.py says what a verdict is (a finding, a known bug, contamination, fuzzshard's own error); reduce.py and
generalize.py shrink and fold it; life.py confirms and writes it; record.py holds its signature, its files and
the known list; rootcause.py matches it to a known torch bug; repro.py writes its script."""
