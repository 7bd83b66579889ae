"""`nmt score`: three labelled scores of a detokenized translation against its reference.

- sacreBLEU (Post 2018) with its signature: the number to compare with sacreBLEU tables.
- chrF (Popović 2015) with its signature, as sacreBLEU computes it.
- Tokenized BLEU: what "Attention Is All You Need" reports (arXiv 1706.03762, section 6.1,
  Table 2: 27.3 base, 28.4 big on newstest2014 en-de; 38.1 and 41.8 en-fr), computed as tensor2tensor's
  `get_ende_bleu.sh` does (compound splitting for a German target only, as that script is for
  German): Moses replace-unicode-punctuation, then the Moses tokenizer (`tokenizer.perl -l TGT`,
  escaping on, no aggressive dash splitting), then every hyphen between two non-space characters
  split off as ``##AT##-##AT##`` (Perl's ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``: matches do not
  overlap, so "a-b-c" becomes "a ##AT##-##AT## b-c", exactly as the script does), then
  `multi-bleu.perl`: case-sensitive BLEU on whitespace-split tokens, no smoothing. The script reads
  an already tokenized reference; here the raw reference goes through the same steps as the
  hypothesis. Roughly one point above sacreBLEU for the same output, which is why the two are
  labelled apart.

`--task parse` scores parse trees instead, as EVALB with COLLINS.prm does (`evalb.py`), written as
``{"task": "parse", "hyp", "ref", "sentences", "signature", "all": {...}, "len<=40": {...},
"problems": [{"line", "reason"}]}`` (each of "all" and "len<=40": recall, precision, f1,
complete_match, average_crossing, tagging_accuracy, and the sentence and bracket counts).

The scores are printed and written as JSON (`--json`, default HYP.scores.json):
``{"hyp", "ref", "segments", "target_lang", "sacrebleu": {"score", "signature", "verbose",
"comparable_to"}, "chrf": {"score", "signature"}, "tokenized_bleu": {"score", "signature", "verbose",
"comparable_to"}}``.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesPunctNormalizer, MosesTokenizer

from nmt_cli.artifacts import atomic_write_text, check_output_file, read_lines
from nmt_cli.config.evaluation import ScoreConfig
from nmt_cli.errors import NmtError, shown
from nmt_cli.evaluation import evalb

_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(tokenized: str) -> str:
    """``rich-text`` -> ``rich ##AT##-##AT## text``, as get_ende_bleu.sh's Perl substitution does."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", tokenized)


def paper_tokenize(lines: list[str], lang: str) -> list[str]:
    """Moses replace-unicode-punctuation, Moses tokenizer (escaping), compound splitting (German)."""
    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    split = split_compounds if lang == "de" else str
    return [split(tokenizer.tokenize(normalizer.replace_unicode_punct(line), return_str=True, escape=True))
            for line in lines]


PAPER = {"de": "the paper's BLEU (27.3 base / 28.4 big, newstest2014 en-de)",
         "fr": "the paper's BLEU (38.1 base / 41.8 big, newstest2014 en-fr)"}


def tokenized_bleu(hyps: list[str], refs: list[str], lang: str) -> Any:
    """multi-bleu.perl on the paper's tokenization: no further tokenization, no smoothing."""
    return BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(
        paper_tokenize(hyps, lang), [paper_tokenize(refs, lang)])


def compute_scores(hyps: list[str], refs: list[str], target_lang: str, tokenize: str) -> dict[str, Any]:
    """All three scores of `hyps` against `refs` (equal length lists of detokenized segments)."""
    bleu_metric, chrf_metric = BLEU(tokenize=tokenize), CHRF()
    bleu, chrf = bleu_metric.corpus_score(hyps, [refs]), chrf_metric.corpus_score(hyps, [refs])
    paper = tokenized_bleu(hyps, refs, target_lang)
    compound = "compound-split:##AT##|" if target_lang == "de" else ""
    return {
        "sacrebleu": {"score": bleu.score, "signature": str(bleu_metric.get_signature()),
                      "verbose": bleu.format(width=2, score_only=False),
                      "comparable_to": "sacreBLEU tables (not the paper's tokenized BLEU)"},
        "chrf": {"score": chrf.score, "signature": str(chrf_metric.get_signature())},
        "tokenized_bleu": {"score": paper.score,
                           "signature": f"moses-tok:{target_lang}|{compound}multi-bleu|smooth:none",
                           "verbose": paper.format(width=2, score_only=False),
                           "comparable_to": PAPER.get(target_lang,
                                                      "tokenized BLEU as papers before sacreBLEU")},
    }


def _reference(cfg: ScoreConfig) -> Path:
    """The reference file: --ref, or --test-set fetched (or taken from the cache) by sacreBLEU."""
    if cfg.ref is not None:
        return Path(cfg.ref)
    if cfg.test_set is None:
        raise NmtError("give the reference with --ref FILE, "
                       "or a sacreBLEU test set with --test-set and --langpair")
    if cfg.langpair is None:
        raise NmtError(f"--test-set {cfg.test_set} needs --langpair (e.g. en-de)")
    from sacrebleu.utils import get_reference_files

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(30)
    try:
        refs = get_reference_files(cfg.test_set, cfg.langpair)
    except (Exception, SystemExit) as e:  # sacreBLEU exits the process when a download fails
        raise NmtError(f"could not get the references of {cfg.test_set} {cfg.langpair} from sacreBLEU "
                       f"({e or 'download failed'}); offline, pass a local reference file "
                       "with --ref") from None
    finally:
        socket.setdefaulttimeout(previous)
    if len(refs) != 1:
        raise NmtError(f"{cfg.test_set} {cfg.langpair} has {len(refs)} references; pass one with --ref")
    return Path(refs[0])


def _target_lang(cfg: ScoreConfig, ref: Path) -> tuple[str, str]:
    """(target language for the Moses tokenizer, a note on how it was chosen)."""
    if cfg.langpair is not None:
        if not re.fullmatch(r"[A-Za-z0-9_]+-[A-Za-z0-9_]+", cfg.langpair):  # codes name tokenizer data files
            raise NmtError(f"--langpair must look like en-de, got {shown(cfg.langpair)}")
        return cfg.langpair.partition("-")[2], ""
    suffix = ref.suffix.lstrip(".")
    if re.fullmatch(r"[a-z]{2}", suffix):
        return suffix, f" (target language {suffix} from the reference's file name; --langpair sets it)"
    return "en", " (target language unknown: English tokenisation; pass --langpair)"


def run(cfg: ScoreConfig) -> None:
    match cfg.task:
        case "translation":
            _score_translation(cfg)
        case "parse":
            _score_parse(cfg)


def _out_json(cfg: ScoreConfig) -> Path:
    hyp_path = Path(cfg.hyp)
    out_json = (Path(cfg.out_json) if cfg.out_json is not None
                else hyp_path.with_name(hyp_path.name + ".scores.json"))
    check_output_file(out_json, "--json")
    return out_json


def paired_lines(hyp_path: Path, ref_path: Path, rule: str) -> tuple[list[str], list[str]]:
    """The lines of the hypotheses and of the reference, refused unless there are as many of each
    (`rule` says what pairs them) and some."""
    hyps, refs = list(read_lines(hyp_path)), list(read_lines(ref_path))
    if len(hyps) != len(refs):
        raise NmtError(f"{hyp_path} has {len(hyps)} lines but the reference {ref_path} has {len(refs)}; "
                       f"{rule}")
    if not hyps:
        raise NmtError(f"{hyp_path} and {ref_path} are empty: there is nothing to score")
    return hyps, refs


def _score_translation(cfg: ScoreConfig) -> None:
    hyp_path, out_json = Path(cfg.hyp), _out_json(cfg)
    ref_path = _reference(cfg)
    target_lang, lang_note = _target_lang(cfg, ref_path)
    hyps, refs = paired_lines(hyp_path, ref_path, "each hypothesis line must translate the same line of "
                              "the reference")
    scores = compute_scores(hyps, refs, target_lang, cfg.tokenize)
    report = {"hyp": str(hyp_path), "ref": str(ref_path), "segments": len(hyps), "target_lang": target_lang,
              **scores}
    atomic_write_text(out_json, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    s, c, t = scores["sacrebleu"], scores["chrf"], scores["tokenized_bleu"]
    print(f"sacreBLEU       {s['score']:6.2f}  {s['signature']}  <- compare with sacreBLEU tables\n"
          f"chrF            {c['score']:6.2f}  {c['signature']}\n"
          f"tokenized BLEU  {t['score']:6.2f}  {t['signature']}  "
          f"<- compare with {t['comparable_to']}{lang_note}\n"
          f"scores written to {out_json}")


def _score_parse(cfg: ScoreConfig) -> None:
    """EVALB's scores of the trees in --hyp against those in --ref (see `evalb.py`)."""
    if cfg.ref is None or cfg.test_set is not None:
        raise NmtError("--task parse needs the reference trees as --ref FILE, one tree per line "
                       "(`nmt prepare ptb` writes them as raw/test.trees); --test-set is for translation")
    hyp_path, ref_path, out_json = Path(cfg.hyp), Path(cfg.ref), _out_json(cfg)
    hyps, refs = paired_lines(hyp_path, ref_path, "each line must hold the tree of the same sentence as "
                              "that line of the reference")
    try:
        every, short, problems = evalb.evaluate(refs, hyps, cfg.cutoff_len)
    except evalb.BadTree as e:
        raise NmtError(f"{ref_path}, {e}: the reference must hold one tree per line, as "
                       "`nmt prepare ptb` writes them") from None
    short_name = f"len<={cfg.cutoff_len}"
    report = {"task": "parse", "hyp": str(hyp_path), "ref": str(ref_path), "sentences": len(hyps),
              "signature": evalb.SIGNATURE, "all": every.report(), short_name: short.report(),
              "problems": [{"line": number, "reason": reason} for number, reason in problems]}
    atomic_write_text(out_json, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    for number, reason in problems[:10]:
        print(f"line {number}: not scored: {reason}")
    if len(problems) > 10:
        print(f"... {len(problems) - 10} more sentences not scored (all listed in {out_json})")
    for name in ("all", short_name):
        r = report[name]
        print(f"{name:9} F1 {r['f1']:6.2f}  recall {r['recall']:6.2f}  precision {r['precision']:6.2f}  "
              f"complete match {r['complete_match']:6.2f}  sentences {r['sentences']} "
              f"({r['error_sentences']} errors, {r['skipped_sentences']} skipped)")
    print(f"{evalb.SIGNATURE}\nscores written to {out_json}")
