"""Looking at results: `nmt score` (`score`: sacreBLEU, chrF, the paper's tokenized BLEU; `evalb`:
parse trees), `nmt plot` (`plot`: training curves) and `nmt attention` (`attention_maps`: a model's
attention weights as pictures or JSON).

What it may import is ARCHITECTURE.md's Packages table (tests/test_layers.py reads it): every other
package; nothing imports it but the CLI.
"""
