#!/usr/bin/env bash
# A tiny treebank in the Penn Treebank's .mrg format, for run.sh --smoke: five files wsj_0001.mrg ..
# wsj_0005.mrg, each with the same few made-up trees (multi-line, an unlabelled outer bracket,
# function tags, co-indexes, empty elements). Usage: tiny_treebank.sh DIR
set -euo pipefail
DIR=${1:?usage: tiny_treebank.sh DIR}
mkdir -p "$DIR"
for n in 1 2 3 4 5; do
    cat > "$DIR/wsj_000$n.mrg" <<'TREES'
( (S
    (NP-SBJ-1 (DT The) (NN cat) )
    (VP (VBD sat)
      (PP-LOC (IN on)
        (NP (DT the) (NN mat) )))
    (. .) ))
( (S
    (NP-SBJ (PRP It) )
    (VP (VBZ is)
      (ADJP-PRD (JJ true) )
      (SBAR (-NONE- 0)
        (S (NP-SBJ (-NONE- *T*-2) ) (VP (VBZ holds) ))))
    (. .) ))
( (S
    (NP-SBJ (NNP Mr.) (NNP Vinken) )
    (, ,)
    (VP (MD will)
      (VP (VB give)
        (PRT (RP up) )
        (NP (PRP$ his) (NN seat) )
        (PP-TMP=3 (IN in) (NP (NNP May) ))))
    (. .) ))
( (FRAG
    (ADVP (RB Not) (RB yet) )
    (PRN (-LRB- -LRB-) (NP (CD 1990) ) (-RRB- -RRB-) )
    (. ?) ))
TREES
done
