"""MLflow pyfunc wrapper for the reward model and the critic (``*ForSequenceClassification`` checkpoints, or the
previous value-head layout: ``RewardScorer.from_pretrained`` reads both), or DPO's implicit reward (``rm.objective:
dpo``, prompt and response columns only).

``predict`` takes a DataFrame with a ``text`` column (or ``prompt`` and
``response`` columns, tokenised exactly as in training), or a list of strings,
and returns one float score per row: the value at the last token of
``text + EOS``.  Served by ``mlflow models serve`` unchanged.
"""

from __future__ import annotations

import mlflow.pyfunc

from rlhf_core.models.scorer import load_one_scorer


class ScorerModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context) -> None:
        self.scorer = load_one_scorer(context.artifacts["model"], device="cpu")

    def predict(self, context, model_input, params=None) -> list[float]:
        import pandas as pd

        if isinstance(model_input, pd.DataFrame):
            if {"prompt", "response"} <= set(model_input.columns):
                scores = self.scorer.score_responses(model_input["prompt"].astype(str).tolist(),
                                                     model_input["response"].astype(str).tolist())
                return scores.tolist()
            if "text" not in model_input.columns:
                if model_input.shape[1] != 1:
                    raise ValueError("expected a `text` column, or `prompt` and `response` columns")
                model_input = model_input.rename(columns={model_input.columns[0]: "text"})
            texts = model_input["text"].astype(str).tolist()
        elif isinstance(model_input, str):
            texts = [model_input]
        else:
            texts = [str(t) for t in model_input]
        return self.scorer.score(texts).tolist()
