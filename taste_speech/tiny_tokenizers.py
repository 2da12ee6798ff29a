"""Small, deterministic stand-ins for TASTE's two tokenizers, for tiny random checkpoints.

The published checkpoint ships the Llama-3.2 tokenizer (``llama_tokenizer/``) and uses Whisper's
tokenizer for the ASR side; neither can be downloaded here. These byte-level BPE tokenizers keep
what the model code relies on: words carry a leading-space marker on their first piece, the Llama
one ends with the Llama-3 special tokens (``<|begin_of_text|>``, ``<|end_of_text|>``,
``<|reserved_special_token_0..54|>``), and both load offline with ``AutoTokenizer``.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(55)]

# A small English corpus: enough to give common words their own pieces.
CORPUS = """
hello hi good morning good afternoon good evening thank you thanks please sorry yes no okay sure
how are you doing today I am fine and you what is your name my name is the weather is nice today
can you help me with my order I would like to book a table for two people at seven tonight
where is the nearest station how much does it cost what time is it now is the store open
I want to change my appointment to next week could you tell me more about the price of this plan
we are calling about your account the payment was received yesterday and everything looks good
please hold on a moment while I check that for you I understand let me see what I can do
the meeting starts at nine in the morning and ends around noon after that we have lunch together
she said that they will arrive tomorrow because the train was late this evening in the city
it was a great day to walk in the park with friends and family under the warm summer sun
one two three four five six seven eight nine ten first second third last next again also very
this that these those there here when why who which would should could will shall may might must
a an the of to in for on with at by from up about into over after before under between out
is are was were be been being have has had do does did say says said go goes went make made
know think take see come want look use find give tell work call try ask need feel become leave
put mean keep let begin seem talk turn start show hear play run move live believe hold bring
happen write provide sit stand lose pay meet include continue set learn change lead understand
watch follow stop create speak read allow add spend grow open walk win offer remember love
consider appear buy wait serve die send expect build stay fall cut reach kill remain suggest
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question government number
night point home water room mother area money story fact month lot right study book eye job
word business issue side kind head house service friend father power hour game line end member
law car city community name president team minute idea kid body information back parent face
others level office door health person art war history party result morning reason research
girl guy moment air teacher force education. Yes, of course. That's right. It's fine. Don't worry.
"""


def _train_bpe(vocab_size: int, specials: list[str], corpus: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    lines = [line for line in corpus.splitlines() if line.strip()]
    lines += [" ".join(str(n) for n in range(i, i + 50)) for i in range(0, 5000, 50)]  # numbers fill the vocab
    tok.train_from_iterator([" " + line for line in lines] * 4, trainer=trainer)
    tok.add_special_tokens(specials)
    return tok


def build_tiny_tokenizers(out_dir: str, llm_vocab_size: int = 1024, asr_vocab_size: int = 512) -> dict:
    """Write ``llama_tokenizer/`` and ``asr_tokenizer/`` under ``out_dir``; return the ids the
    config needs (``sos_id`` = <|begin_of_text|>, ``end_of_text_id``, reserved 50..54)."""
    if llm_vocab_size < 512 or asr_vocab_size < 300:
        raise ValueError("tiny tokenizers need llm_vocab_size >= 512 and asr_vocab_size >= 300 (byte alphabet + merges)")
    llm = _train_bpe(llm_vocab_size, LLAMA_SPECIALS, CORPUS)
    if llm.get_vocab_size() != llm_vocab_size:
        raise ValueError(f"could not reach a vocabulary of {llm_vocab_size} (got {llm.get_vocab_size()}); use a smaller size")
    llm_fast = PreTrainedTokenizerFast(
        tokenizer_object=llm, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
        additional_special_tokens=LLAMA_SPECIALS[2:], clean_up_tokenization_spaces=False,
    )
    llm_fast.save_pretrained(os.path.join(out_dir, "llama_tokenizer"))
    asr = _train_bpe(asr_vocab_size, ["<|endoftext|>"], CORPUS)
    asr_fast = PreTrainedTokenizerFast(tokenizer_object=asr, eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    asr_fast.save_pretrained(os.path.join(out_dir, "asr_tokenizer"))
    ids = {name: llm.token_to_id(name) for name in LLAMA_SPECIALS}
    return {
        "sos_id": ids["<|begin_of_text|>"],
        "end_of_text_id": ids["<|end_of_text|>"],
        "reserved_50_54": [ids[f"<|reserved_special_token_{i}|>"] for i in range(50, 55)],
    }
