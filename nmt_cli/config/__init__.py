"""Every setting of every stage, in one place: a typed dataclass per stage, the only place a default,
a help text and a command-line flag are written.

`core` resolves a config from its defaults, a YAML file and the command line (defaults < YAML <
command line), converts and checks each value by its field, and writes the resolved config back
as YAML; `options` turns a config's fields into the options of its `nmt` command. The stage configs
are grouped as the package is: `data` (prepare, bpe, binarize), `model` (the Transformer and its
presets), `train` (train, average), `inference` (translate), `evaluation` (score, plot, attention),
`convert` (import and export), `serve` (the server: translate's settings and its limits). Defaults
follow "Attention Is All You Need" (arXiv 1706.03762) unless the help text says otherwise.

What it may import is ARCHITECTURE.md's Packages table (tests/test_layers.py reads it), besides
PyYAML and (in `options`) Typer. Never torch nor any other package of `nmt_cli` but `errors`:
`nmt --help` imports this package and must stay fast.
"""
