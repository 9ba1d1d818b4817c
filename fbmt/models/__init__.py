"""Models written in plain PyTorch: the reference GPT (main job, tests, benchmarks), and the zoo, which
loads and saves Hugging Face checkpoint folders (ModelCenter's role; `fbmt.models.pretrained`)."""

from fbmt.models.bert import Bert, BertClassifier, BertConfig, BertMLM
from fbmt.models.gpt import GPT, GPTConfig, init_weights
from fbmt.models.gpt2 import GPT2, GPT2Config
from fbmt.models.llama import Llama, LlamaConfig, Output
from fbmt.models.pretrained import CheckpointError, PretrainedModel, load_tokenizer
from fbmt.models.t5 import T5, T5Config

__all__ = [
    "GPT",
    "GPT2",
    "Bert",
    "BertClassifier",
    "BertConfig",
    "BertMLM",
    "CheckpointError",
    "GPT2Config",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "Output",
    "PretrainedModel",
    "T5",
    "T5Config",
    "init_weights",
    "load_tokenizer",
]
