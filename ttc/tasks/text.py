"""The text classifier: a text column (or several, joined), word or Hugging Face tokens."""
from __future__ import annotations

from dataclasses import dataclass

from ttc.tasks.base import Parts, Regularisation, Task

# what an hf network's inputs after the token ids hold, as the manifest tells a deployment
_EXTRA_INPUT_VALUES = {"attention_mask": "1 where {first} is not padding_id, else 0",
                       "token_type_ids": "0 (one segment)"}


@dataclass(frozen=True)
class TextClassifier(Task):
    def graph_input(self, preprocessing: dict) -> dict:
        if not preprocessing.get("graph_inputs"):  # our networks: word ids, 0 pads
            return {"name": "token_ids", "dtype": "int64", "shape": ["batch", "length"],
                    "padding_id": 0}
        first, *others = preprocessing["graph_inputs"]  # an hf arch
        return {"name": first, "dtype": "int64", "shape": ["batch", "length"],
                "padding_id": preprocessing["pad_id"],
                "max_length": preprocessing["max_length"],
                "extra_inputs": [{"name": name, "dtype": "int64", "shape": ["batch", "length"],
                                  "value": _EXTRA_INPUT_VALUES[name].format(first=first)}
                                 for name in others]}

    def report_sizes(self, preprocessing: dict) -> dict:
        return {"vocab_size": preprocessing["vocab_size"],
                "max_length": preprocessing["max_length"],
                "tokenizer": preprocessing.get("tokenizer", "words")}

    def factory_sizes(self, preprocessing: dict) -> dict:
        return {"vocab_size": preprocessing["vocab_size"],
                "max_length": preprocessing["max_length"]}


TASK = TextClassifier(name="text_classifier", kind="text", archs=("bag", "cnn", "transformer"),
                      parts=Parts(reader="ttc.inputs.data:load_table_dataset",
                                  rows="ttc.serving.batch:TextRows",
                                  networks="ttc.nets.models:TEXT_NETWORKS",
                                  modules="ttc.nets.models:TEXT_MODULES"),
                      regularisation={
                          "bag": Regularisation(0.3, 1e-4, source="ours"),
                          "cnn": Regularisation(0.5, 0.0, max_norm=3.0, source=(
                              "Kim 2014: dropout 0.5 on the pooled features, max-norm 3 on the "
                              "output weights, no weight decay")),
                          "transformer": Regularisation(0.1, 0.01, source=(
                              "Vaswani et al. 2017 (dropout 0.1); AdamW weight decay 0.01 as "
                              "in BERT")),
                          "hf": Regularisation(None, 0.01, source=(
                              "the checkpoint's own dropout (0.1 in BERT-style configs); "
                              "weight decay 0.01 as in BERT's fine-tuning"))},
                      default_tta="token_dropout:0.1",
                      input_role="text", input_field="text", reads_lines=True, hf_archs=True,
                      teacher=True)
