"""Prompt rendering to token ids: one BOS where a chat template writes it, the template's end-of-turn token found
and used to end completions, and over-long prompts skipped or truncated and counted."""
import pytest

from orchestrator.workers.prompts import PromptRenderer, RenderedTask
from rollout.tasks import Problem

BOS, EOT, EOS = "<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"
# A Llama-3-style template: it writes BOS itself, and ends every turn with <|eot_id|>.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] }}" + EOT + "{% endfor %}"
            "{% if add_generation_prompt %}[assistant]\n{% endif %}")


@pytest.fixture(scope="module")
def llama_like():
    """A tokenizer that adds BOS to plain text, as Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOT, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["[user]\nwhat is 2+2?", "[assistant]\n4", "plain text prompt"], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS)
    fast.chat_template = TEMPLATE
    return fast


CHAT = Problem("t", "", "4", messages=({"role": "user", "content": "what is 2+2?"},))
PLAIN = Problem("t", "plain text prompt", "4")


def test_chat_prompts_get_one_bos_and_plain_prompts_get_the_tokenizers_own(llama_like):
    bos = llama_like.bos_token_id
    renderer = PromptRenderer(llama_like)
    chat, _ = renderer.render(CHAT)
    assert chat.prompt.startswith(BOS) and chat.prompt.endswith("[assistant]\n")
    assert chat.prompt_ids[0] == bos and chat.prompt_ids.count(bos) == 1
    assert list(chat.prompt_ids) == llama_like.apply_chat_template(list(CHAT.messages), tokenize=True,
                                                                   add_generation_prompt=True, return_dict=False)
    assert llama_like(chat.prompt).input_ids.count(bos) == 2  # what re-tokenising the rendered text would do
    plain, _ = renderer.render(PLAIN)
    assert list(plain.prompt_ids) == llama_like(PLAIN.prompt).input_ids and plain.prompt_ids[0] == bos


def test_end_of_turn_ends_chat_completions_and_eos_ends_plain_ones(llama_like):
    renderer = PromptRenderer(llama_like)
    eot, eos = llama_like.convert_tokens_to_ids(EOT), llama_like.eos_token_id
    assert renderer.end_of_turn_ids() == [eot]
    assert renderer.completion_ids(CHAT, "4")[-1] == eot
    assert renderer.completion_ids(PLAIN, "4")[-1] == eos
    base = PromptRenderer(llama_like, "none")
    assert base.end_of_turn_ids() == [] and base.completion_ids(CHAT, "4")[-1] == eos


def test_the_tiny_models_turn_ends_with_eos(tmp_path):
    from transformers import AutoTokenizer

    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "tiny", "1+1=2\n", TinyModelConfig()))
    assert PromptRenderer(tok).end_of_turn_ids() == [tok.eos_token_id]


class _Fixed:
    name = "fixed"

    def __init__(self, problems):
        self._problems = problems

    def problems(self, seed, iteration, n):
        return self._problems[:n]

    def sft_examples(self, seed, n):
        return [(p.prompt, p.answer) for p in self._problems[:n]]


def test_overlong_prompts_are_skipped_or_truncated_and_counted(llama_like):
    short = Problem("t", "plain", "1")
    long = Problem("t", "plain text prompt " * 20, "2")
    limit = len(llama_like(short.prompt).input_ids) + 1
    task = RenderedTask(_Fixed([short, long, short]), PromptRenderer(llama_like, max_prompt_tokens=limit))
    kept, counts = task.rendered_problems(0, 1, 3)
    assert [p.answer for p in kept] == ["1", "1"] and counts.metrics() == {"prompts_truncated": 0,
                                                                           "prompts_skipped": 1}
    assert [p.answer for p, _ in task.sft_pairs(0, 3)] == ["1", "1"]
    cut = RenderedTask(_Fixed([short, long]), PromptRenderer(llama_like, max_prompt_tokens=limit,
                                                             overlong="truncate"))
    kept, counts = cut.rendered_problems(0, 1, 2)
    assert counts.metrics() == {"prompts_truncated": 1, "prompts_skipped": 0}
    assert list(kept[1].prompt_ids) == llama_like(long.prompt).input_ids[-limit:]  # the end is kept
