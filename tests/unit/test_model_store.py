from pathlib import Path

import pytest

from userrl_megatron.cli import main
from userrl_megatron.errors import UserError
from userrl_megatron.model_store import EMBEDDED_MODELS, qwen3_tokenizer_dir, resolve_model


def test_resolve_directory_is_identity(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


def test_resolve_unknown_name_says_what_exists() -> None:
    with pytest.raises(UserError, match=r"neither a directory nor an embedded model \(smollm2-135m-instruct"):
        resolve_model("gpt-17")


def test_unfetched_model_without_fetch_names_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USERRL_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="run `userrl model fetch smollm2-135m-instruct`"):
        resolve_model("smollm2-135m-instruct", fetch=False)


def test_model_list(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USERRL_CACHE", str(tmp_path))
    assert main(["model", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EMBEDDED_MODELS) and "not fetched" in out


def test_qwen3_tokenizer_is_shipped() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    assert tok.convert_tokens_to_ids("<tool_call>") != tok.unk_token_id
    assert "tools" in tok.chat_template
