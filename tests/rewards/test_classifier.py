"""A reward model's classifier: its scores are the checkpoint's own logit on each text (batched, right-padded, as TRL
scores), the text is the conversation through the reward model's chat template, and a checkpoint that cannot be a
reward model fails in one line naming the key before anything loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose
from asyncrl.plan.assemble import plan_run
from asyncrl.rewards.classifier import check_tokenizer, load_classifier
from asyncrl.rewards.reward_model import RewardModelOptions

PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "What is 10 - 7?"}]] * 3
ANSWERS = ["\\boxed{5}", "3", "the answer is \\boxed{5}, surely", "", "\\boxed{3}", "a much longer completion here"]
COMPLETIONS = [[{"role": "assistant", "content": answer}] for answer in ANSWERS]


def alone(path: Path, texts: list[str]) -> list[float]:
    """The checkpoint's logit on each text, one text per forward (no padding anywhere)."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
                for text in texts]  # fmt: skip


def test_scores_are_the_classifiers_logit_on_each_conversation(tiny_classifier):
    path = tiny_classifier()
    classifier = load_classifier(RewardModelOptions(path=str(path), batch_size=4), "reward_funcs[0]",
                                 torch.device("cpu"), {})  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = classifier.texts(PROMPTS, COMPLETIONS)
    conversations = [[*prompt, *completion] for prompt, completion in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert texts == [tokenizer.apply_chat_template(conversation, tokenize=False) for conversation in conversations]
    assert texts[0] == "<|user|>What is 2 + 3?<|end|><|assistant|>\\boxed{5}<|end|>"  # the reward model's template
    scores = classifier.score(PROMPTS, COMPLETIONS)  # two forwards (4 + 2), of different lengths, right-padded
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(alone(path, texts)), rtol=1e-5, atol=1e-5)
    assert len(set(scores)) == len(scores)


def test_plain_text_prompts_are_scored_as_prompt_plus_completion(tiny_classifier):
    path = tiny_classifier()
    classifier = load_classifier(RewardModelOptions(path=str(path)), "reward_funcs[0]", torch.device("cpu"), {})
    prompts, completions = ["What is 2 + 3? ", "What is 1 + 1? "], ["5", "it is 2"]
    assert classifier.texts(prompts, completions) == ["What is 2 + 3? 5", "What is 1 + 1? it is 2"]
    torch.testing.assert_close(torch.tensor(classifier.score(prompts, completions)),
                               torch.tensor(alone(path, ["What is 2 + 3? 5", "What is 1 + 1? it is 2"])),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def causal_lm_saying_it_classifies(source: Path, target: Path) -> Path:
    """A causal LM's checkpoint whose config.json claims a one-label sequence classifier: it has no score head."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(architectures=["Qwen3ForSequenceClassification"], id2label={"0": "LABEL_0"},
                  label2id={"LABEL_0": 0})  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_checkpoint_without_a_trained_head_is_refused_as_it_loads(random_tiny_model_dir, tmp_path):
    path = causal_lm_saying_it_classifies(random_tiny_model_dir, tmp_path / "claims")
    with pytest.raises(ConfigError, match=r"^reward_funcs\[1\]\.path=.* lacks weights a sequence classifier needs "
                                          r"\(score\.weight\)"):  # fmt: skip
        load_classifier(RewardModelOptions(path=str(path)), "reward_funcs[1]", torch.device("cpu"), {})


def test_conversations_need_the_reward_models_chat_template(tiny_classifier, tmp_path):
    path = shutil.copytree(tiny_classifier(), tmp_path / "no-template")
    (path / "chat_template.jinja").unlink()
    options = RewardModelOptions(path=str(path))
    check_tokenizer(options, "reward_funcs[0]", conversational=False)
    with pytest.raises(ConfigError, match=r"^reward_funcs\[0\]\.path=.*: its tokenizer has no chat template"):
        check_tokenizer(options, "reward_funcs[0]", conversational=True)


def reward_model_override(path: str, position: int = 0) -> list[str]:
    entries = ["{name: length}"] * position + [f"{{name: reward_model, path: '{path}'}}"]
    return [f"reward_funcs=[{', '.join(entries)}]"]


@pytest.mark.parametrize(
    ("which", "line"),
    [
        ("missing", "reward_funcs[1].path={path}: no such directory; give a sequence-classification checkpoint's "
                    "directory (save_pretrained layout) or its Hub id"),
        ("causal", "reward_funcs[1].path={path} is a Qwen3ForCausalLM, not a sequence classifier: a reward model is a "
                   "*ForSequenceClassification checkpoint with num_labels=1 (TRL's RewardTrainer trains one)"),
        ("labels", "reward_funcs[1].path={path} has num_labels=2: the reward is its one logit; a reward model is a "
                   "*ForSequenceClassification checkpoint with num_labels=1 (TRL's RewardTrainer trains one)"),
    ],
)  # fmt: skip
def test_a_checkpoint_that_is_no_reward_model_fails_in_one_line_naming_the_key(
    which, line, tiny_classifier, random_tiny_model_dir, tmp_path
):  # fmt: skip
    path = {"missing": tmp_path / "nope", "causal": random_tiny_model_dir, "labels": tiny_classifier(2)}[which]
    with pytest.raises(ConfigError) as error:
        plan_run(compose(reward_model_override(str(path), position=1)))
    assert str(error.value) == line.format(path=path)


def test_the_reward_model_entry_needs_a_path():
    with pytest.raises(ConfigError) as error:
        plan_run(compose(["reward_funcs=[{name: reward_model}]"]))
    assert str(error.value) == ("reward_funcs[0]: reward 'reward_model': needs path=CHECKPOINT (a "
                                "sequence-classification checkpoint's directory or Hub id)")  # fmt: skip


def test_the_cli_refuses_it_in_one_line_before_anything_starts(invoke, random_tiny_model_dir):
    result = invoke(["config", *reward_model_override(str(random_tiny_model_dir))])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"config error: reward_funcs[0].path={random_tiny_model_dir} is a Qwen3ForCausalLM, not a sequence "
        "classifier: a reward model is a *ForSequenceClassification checkpoint with num_labels=1 (TRL's RewardTrainer "
        "trains one)"
    ]


BRACKETS = "{%- for m in messages -%}[{{ m.role }}] {{ m.content }};{%- endfor -%}"


def other_tokenizer(source: Path, target: Path, template: str = BRACKETS, extra: int = 0) -> Path:
    """The reward model's vocabulary saved apart with another chat template (and ``extra`` tokens added)."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = template
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(extra)])
    tokenizer.save_pretrained(target)
    return target


def test_the_tokenizer_option_reads_with_another_tokenizer(tiny_classifier, tmp_path):
    """TRL's reward_processing_classes: the conversation is rendered and tokenized by the tokenizer given, not the
    checkpoint's own."""
    path, tokenizer = tiny_classifier(), other_tokenizer(tiny_classifier(), tmp_path / "brackets")
    plan = plan_run(compose([f"reward_funcs=[{{name: reward_model, path: '{path}', tokenizer: '{tokenizer}'}}]"]))
    options = plan.components.rewards[0].fn.options
    assert options.tokenizer == str(tokenizer)
    classifier = load_classifier(options, "reward_funcs[0]", torch.device("cpu"), {})
    texts = classifier.texts(PROMPTS, COMPLETIONS)
    assert texts[0] == "[user] What is 2 + 3?;[assistant] \\boxed{5};"
    torch.testing.assert_close(torch.tensor(classifier.score(PROMPTS, COMPLETIONS)),
                               torch.tensor(alone(path, texts)), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_a_tokenizer_the_reward_model_cannot_embed_is_refused_in_one_line(tiny_classifier, tmp_path):
    tokenizer = other_tokenizer(tiny_classifier(), tmp_path / "wider", extra=3)
    options = RewardModelOptions(path=str(tiny_classifier()), tokenizer=str(tokenizer))
    size = len(AutoTokenizer.from_pretrained(tokenizer))
    with pytest.raises(ConfigError) as error:
        load_classifier(options, "reward_funcs[0]", torch.device("cpu"), {})
    assert str(error.value) == (
        f"reward_funcs[0].tokenizer={tokenizer}: its tokenizer has {size} tokens, more than "
        f"the {size - 3} the reward model embeds; give the tokenizer it was trained with"
    )


def test_a_missing_tokenizer_is_refused_before_anything_loads(tiny_classifier, tmp_path):
    entry = f"{{name: reward_model, path: '{tiny_classifier()}', tokenizer: '{tmp_path / 'nope'}'}}"
    with pytest.raises(ConfigError) as error:
        plan_run(compose([f"reward_funcs=[{{name: length}}, {entry}]"]))
    assert str(error.value) == (
        f"reward_funcs[1].tokenizer={tmp_path / 'nope'}: no such directory; give a "
        "tokenizer's directory or its Hub id, or drop it to read with the checkpoint's own"
    )


def cache_revisions(hub_cache: Path, repo_id: str, snapshots: dict[str, Path]) -> None:
    """huggingface_hub's cache layout: one snapshot per commit, refs/<revision> naming each."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    for index, (revision, source) in enumerate(snapshots.items()):
        commit = str(index) * 40
        shutil.copytree(source, repo / "snapshots" / commit)
        (repo / "refs" / revision).write_text(commit)


def test_the_revision_option_picks_the_reward_models_commit_on_the_hub(tiny_classifier, monkeypatch, tmp_path):
    """org/rm's main branch holds a two-label classifier, its v1 tag the reward model: revision=v1 checks and loads
    v1 (from the Hub cache here: the tests run offline)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cache_revisions(tmp_path / "hub", "org/rm", {"main": tiny_classifier(2), "v1": tiny_classifier(1)})
    with pytest.raises(ConfigError, match=r"^reward_funcs\[0\]\.path=org/rm has num_labels=2"):
        plan_run(compose(["reward_funcs=[{name: reward_model, path: org/rm}]"]))
    plan = plan_run(compose(["reward_funcs=[{name: reward_model, path: org/rm, revision: v1}]"]))
    classifier = load_classifier(plan.components.rewards[0].fn.options, "reward_funcs[0]", torch.device("cpu"), {})
    texts = classifier.texts(PROMPTS, COMPLETIONS)
    torch.testing.assert_close(torch.tensor(classifier.score(PROMPTS, COMPLETIONS)),
                               torch.tensor(alone(tiny_classifier(1), texts)), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_a_reward_model_with_its_own_code_loads_only_as_trusted(custom_code_classifier, tiny_classifier):
    """TRL applies trust_remote_code to reward models; asyncrl's one switch is model.trust_remote_code."""
    options = RewardModelOptions(path=str(custom_code_classifier))
    with pytest.raises(ConfigError) as error:
        check_tokenizer(options, "reward_funcs[0]", conversational=True)
    assert str(error.value) == (
        f"reward_funcs[0].path={custom_code_classifier} is a asyncrl_test_rm checkpoint that "
        "loads with its own code (auto_map in its config.json): set model.trust_remote_code="
        "true to run it (it applies to the policy and the reward models, as TRL's)"
    )
    check_tokenizer(options, "reward_funcs[0]", conversational=True, trust_remote_code=True)
    classifier = load_classifier(options, "reward_funcs[0]", torch.device("cpu"), {}, trust_remote_code=True)
    assert type(classifier.model).__name__ == "TinyRMForSequenceClassification"
    texts = classifier.texts(PROMPTS, COMPLETIONS)
    torch.testing.assert_close(torch.tensor(classifier.score(PROMPTS, COMPLETIONS)),
                               torch.tensor(alone(tiny_classifier(), texts)), rtol=1e-5, atol=1e-5)  # fmt: skip
