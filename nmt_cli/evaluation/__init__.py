"""Looking at results: `nmt score` (sacreBLEU, chrF, the paper's tokenized BLEU), `nmt plot`
(training curves) and `nmt attention` (a model's attention weights as pictures or JSON).

May import: every other package; nothing imports it but the CLI.
"""
