"""Small stand-in tokenizers for tiny TASTE checkpoints (tests, demos; no hub access).

The published checkpoint ships the Llama-3.2 tokenizer (128 256 ids) in ``llama_tokenizer/`` and
names whisper-large-v3 for the ASR tokenizer; neither fits a model with a 1 024-row embedding.
``build_tiny_tokenizers`` trains two byte-level BPE tokenizers on a small English text embedded
below (deterministic, no download) and saves them so ``AutoTokenizer.from_pretrained`` loads them
offline:

* ``llama_tokenizer/`` - Llama-3 style: Llama-3 pre-tokenizer split, byte-level pieces (a word
  after a space starts with the 'Ġ' marker, so it decodes with a leading space), and the LAST ids
  are the Llama-3.2 special tokens in their published order: ``<|begin_of_text|>`` (the LM's
  sos), ``<|end_of_text|>``, ``<|reserved_special_token_0|>``, ``_1``, ``<|finetune_right_pad_id|>``,
  ``_2``, the header / eot / python tokens, then ``_3`` ... ``_N``. With the default N = 54 that
  includes the conversation markers ``_50`` ... ``_54`` (spec §9.5).
* ``asr_tokenizer/`` - Whisper-like: GPT-2 byte-level BPE with ``<|endoftext|>`` as its last id.
  All ids are below ``asr_vocab_size``; keep that <= the speech decoder's ``text_token_size``
  (the audio tower embeds ASR ids in its 51 866-row Whisper table, the speech decoder in a
  ``text_token_size``-row table).

Both round-trip ordinary English (``decode(encode(x)) == x``) and, being byte-level, can encode
any text.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

LLAMA_TOKENIZER_DIR = "llama_tokenizer"
ASR_TOKENIZER_DIR = "asr_tokenizer"

BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
ASR_END_OF_TEXT = "<|endoftext|>"

# Llama-3's pre-tokenizer split: contractions, letter runs with one optional leading non-letter
# (the space), numbers in groups of up to three, punctuation runs, newlines, other whitespace.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_BYTE_ALPHABET = 256  # byte-level BPE always contains one piece per byte


def llama3_special_tokens(num_reserved: int = 55) -> list[str]:
    """Llama-3.1/3.2 special tokens in id order, up to ``<|reserved_special_token_{num_reserved-1}|>``.

    Real layout (offsets from 128000): 0 begin_of_text, 1 end_of_text, 2 reserved_0,
    3 reserved_1, 4 finetune_right_pad_id, 5 reserved_2, 6 start_header_id, 7 end_header_id,
    8 eom_id, 9 eot_id, 10 python_tag, then reserved_k at 8 + k for k >= 3."""
    if num_reserved < 3:
        raise ValueError(f"num_reserved must be >= 3 (reserved_0..2 sit among the named tokens), got {num_reserved}")
    reserved = [f"<|reserved_special_token_{k}|>" for k in range(num_reserved)]
    named = [
        BEGIN_OF_TEXT,
        END_OF_TEXT,
        reserved[0],
        reserved[1],
        "<|finetune_right_pad_id|>",
        reserved[2],
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    return named + reserved[3:]


@dataclass(frozen=True)
class TinyTokenizers:
    """Where the tokenizers were written and the ids a tiny config needs.

    Attributes also read like a dict (``info["sos_id"]``); ``info["reserved_50_54"]`` lists the
    ids of the conversation markers ``<|reserved_special_token_50..54|>``."""

    llm_dir: str
    asr_dir: str
    llm_vocab_size: int
    asr_vocab_size: int
    sos_id: int  # <|begin_of_text|>: spoken_lm_config.sos_id
    end_of_text_id: int  # <|end_of_text|>: banned by the sampler
    asr_end_of_text_id: int  # <|endoftext|> of the ASR tokenizer (its last id)
    reserved_ids: dict[int, int] = field(default_factory=dict)  # k -> id of <|reserved_special_token_k|>

    def reserved(self, k: int) -> int:
        return self.reserved_ids[k]

    @property
    def reserved_50_54(self) -> list[int]:
        return [self.reserved_ids[k] for k in range(50, 55)]

    def __getitem__(self, key: str):
        if key == "reserved_50_54" or key in self.__dataclass_fields__:
            return getattr(self, key)
        raise KeyError(key)


def build_tiny_tokenizers(
    out_dir: str | os.PathLike,
    llm_vocab_size: int = 1024,
    asr_vocab_size: int = 512,
    seed: int = 0,
    num_reserved: int = 55,
) -> TinyTokenizers:
    """Train and save ``out_dir/llama_tokenizer`` and ``out_dir/asr_tokenizer``.

    Deterministic for given arguments. ``seed`` 0 trains on the embedded text as it is; another
    seed repeats a seeded random subset of its lines (changing the pair counts, hence the merges),
    for checkpoints that should not share a vocabulary."""
    specials = llama3_special_tokens(num_reserved)
    _check_size("llm_vocab_size", llm_vocab_size, len(specials))
    _check_size("asr_vocab_size", asr_vocab_size, 1)
    lines = training_lines(seed)
    out_dir = os.fspath(out_dir)

    llm_dir = os.path.join(out_dir, LLAMA_TOKENIZER_DIR)
    llm = _train_byte_bpe(lines, llm_vocab_size - len(specials), llama_split=True)
    _add_specials(llm, specials)
    bos_id = llm.token_to_id(BEGIN_OF_TEXT)
    _add_bos_template(llm, BEGIN_OF_TEXT, bos_id)
    _save(llm, llm_dir, bos_token=BEGIN_OF_TEXT, eos_token=END_OF_TEXT, model_max_length=131072)

    asr_dir = os.path.join(out_dir, ASR_TOKENIZER_DIR)
    asr = _train_byte_bpe(lines, asr_vocab_size - 1, llama_split=False)
    _add_specials(asr, [ASR_END_OF_TEXT])
    _save(asr, asr_dir, bos_token=ASR_END_OF_TEXT, eos_token=ASR_END_OF_TEXT, unk_token=ASR_END_OF_TEXT,
          model_max_length=1024)

    reserved = {k: llm.token_to_id(f"<|reserved_special_token_{k}|>") for k in range(num_reserved)}
    return TinyTokenizers(
        llm_dir=llm_dir,
        asr_dir=asr_dir,
        llm_vocab_size=llm.get_vocab_size(with_added_tokens=True),
        asr_vocab_size=asr.get_vocab_size(with_added_tokens=True),
        sos_id=bos_id,
        end_of_text_id=llm.token_to_id(END_OF_TEXT),
        asr_end_of_text_id=asr.token_to_id(ASR_END_OF_TEXT),
        reserved_ids=reserved,
    )


def _check_size(name: str, size: int, num_special: int) -> None:
    smallest = _BYTE_ALPHABET + num_special + 1
    if not isinstance(size, int) or size < smallest or size > MAX_VOCAB_SIZE:
        raise ValueError(
            f"{name} must be an integer in [{smallest}, {MAX_VOCAB_SIZE}] (256 byte pieces + "
            f"{num_special} special tokens + merges learnt from the built-in text), got {size!r}"
        )


def training_lines(seed: int = 0) -> list[str]:
    lines = [line.strip() for line in _TRAINING_TEXT.strip().splitlines() if line.strip()]
    lines += [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 12)]
    if seed:
        rng = random.Random(seed)
        lines = lines + [line for line in lines if rng.random() < 0.5]
    return lines


def _train_byte_bpe(lines: list[str], size: int, llama_split: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if llama_split:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:  # GPT-2 / Whisper split
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    learnt = tokenizer.get_vocab_size(with_added_tokens=True)
    if learnt != size:
        raise ValueError(
            f"the built-in training text yields only {learnt} BPE pieces, {size} were asked; "
            "use a smaller vocabulary size"
        )
    return tokenizer


def _add_specials(tokenizer, names: list[str]) -> None:
    from tokenizers import AddedToken

    first = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    for offset, name in enumerate(names):  # appended in order: the specials are the last ids
        assert tokenizer.token_to_id(name) == first + offset, name


def _add_bos_template(tokenizer, bos: str, bos_id: int) -> None:
    """Like Llama-3: ``add_special_tokens=True`` prepends <|begin_of_text|>."""
    from tokenizers import processors

    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        ),
    ])


def _save(tokenizer, directory: str, model_max_length: int, **special) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        clean_up_tokenization_spaces=False,  # keep decode(encode(x)) == x (" ." stays " .")
        model_max_length=model_max_length,
        **special,
    )
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    # The class name every transformers version resolves (v5 writes its new backend name; the
    # published Llama-3 tokenizer_config.json says PreTrainedTokenizerFast too).
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


# -- training text ------------------------------------------------------------------------------
# Written for this module: everyday English so that common words get whole-word pieces.
_TRAINING_TEXT = """
The morning was quiet, and the kitchen smelled of coffee and warm bread.
She opened the window, looked at the garden, and said that it would rain before noon.
We walked along the river for an hour and talked about our plans for the summer.
He could not find his keys, so he called his sister and asked her to bring the spare set.
The children were playing in the park while their parents sat on a bench in the sun.
I think we should leave early tomorrow because the road through the mountains is long.
Please tell me what you remember about the first house you lived in.
They built a small boat from old wood and sailed it across the lake last year.
The teacher explained the question again, and this time everyone understood the answer.
My brother works at a hospital in the city and often comes home late at night.
It is important to drink enough water, sleep well, and take a walk every day.
The old man told a story about a dog that waited at the station for many years.
Would you like some tea, or do you prefer a glass of cold juice?
The music was so loud that we had to shout to hear each other.
After dinner we washed the dishes, turned off the lights, and went to bed.
The company announced a new product that helps people learn languages at home.
Our train was delayed by twenty minutes, but we still arrived in time for the meeting.
She has been reading a long book about the history of science and medicine.
The weather was cold and windy, so we stayed inside and played cards by the fire.
If you need any help with your work, just let me know and I will come over.
The doctor said that I should rest for a few days and eat more fruit and vegetables.
Every spring the birds return to the trees behind our school and build their nests.
I have never seen such a beautiful sunset over the sea.
He was thinking about the people he had met during his travels around the world.
The store on the corner sells fresh fish, eggs, milk, cheese, and flowers.
We are going to visit our grandmother next weekend and stay for two nights.
Nobody knew why the lights in the building went out at exactly nine o'clock.
The students asked the professor whether the exam would be easy or difficult.
You can't always get what you want, but you'll often find what you need.
They're planning a party for their friend who is moving to another country.
I'd rather walk than drive when the streets are full of cars.
What time does the library open on Sunday, and how long does it stay open?
The river flows slowly through the valley, past farms, fields, and small villages.
Most of the time the cat sleeps on the sofa, but sometimes it hides under the table.
There were three apples, two oranges, and one banana left in the basket.
A good friend listens carefully and speaks honestly, even when it is hard.
The plane landed safely, and the passengers clapped and smiled.
During the winter the days are short and the nights are long and dark.
She wrote a letter to her family and sent it with a photo of her new home.
We need to buy bread, butter, rice, potatoes, tomatoes, and a bottle of oil.
The city was busy with people going to work, shopping, and meeting friends.
He learned to play the piano when he was seven years old.
Can you hear the sound of the rain on the roof?
It was the best day of the summer, warm and bright, with a gentle wind from the west.
The number of visitors grew from 120 to 4500 in less than 3 years.
Before you start, read the instructions carefully and check that you have everything.
My favourite colours are blue and green, like the sky and the forest.
The small village had one church, one school, and one shop that sold everything.
I'm sorry I'm late, the bus didn't come and I had to walk all the way here.
Let's meet at the station at half past six and take the next train to the coast.
The scientist measured the temperature of the water every hour for a week.
People often say that time moves faster when you are having fun.
The baby laughed when the dog licked her hand.
We watched a film about a group of friends who travel across the desert.
The farmer woke up before the sun to feed the animals and work in the fields.
Thank you very much for your kind words and your patience.
Speech is a sequence of words, and every word has its own sound, rhythm, and meaning.
The voice on the phone was calm, clear, and friendly.
Language models predict the next word from the words that came before it.
Listen to the question, think for a moment, and then give a short answer.
Hello, how are you doing today? I'm fine, thanks, and you?
Hi there, good morning, good afternoon, good evening, and good night.
Okay, sure, no problem, that sounds great, let me check and call you back.
Yes, of course, I understand what you mean, please go on.
Where are you from, and what do you do for a living?
I would like to book a table for two people at seven tonight, please.
Could you say that again a little more slowly, please?
That's right, it's fine, don't worry about it, we can try again later.
"""

_WORDS = """
a about above across act add afraid after afternoon again against age ago agree air all allow
almost alone along already also always am among an and angry animal another answer any anyone
anything appear apple are area arm around arrive art as ask at attention aunt autumn away baby back
bad bag ball bank base basket be beach bear beautiful because become bed been before began begin
behind believe below best better between big bird birthday bit black blood blow blue board boat body
book born both bottom box boy brain bread break breakfast bright bring brother brown build burn busy
but buy by cake call came camera can car card care carry case cat catch cause center certain chair
chance change check child children choose circle city class clean clear climb clock close clothes
cloud coast coat cold colour come common company complete computer condition consider contain
continue cook cool copy corner correct cost could count country course cover cow cross cry cup
cut dance danger dark daughter day dead deal dear decide deep describe design desk develop did die
different difficult dinner direction discover do doctor does dog door double down draw dream dress
drink drive drop dry during each ear early earth easy eat edge egg eight either else end energy
engine enough enter equal even evening event ever every exact example except excite exercise expect
experience explain eye face fact fall family famous far farm fast father fear feel feet few field
fight figure fill final find fine finger finish fire first fish five floor flower fly follow food
foot for force forest forget form forward four free fresh friend from front fruit full fun game
garden gas gather gave general gentle get girl give glad glass go gold gone good got great green
grey ground group grow guess guide hair half hand happen happy hard has hat have he head hear heart
heat heavy held help her here high hill him his history hold hole holiday home hope horse hospital
hot hotel hour house how however huge human hundred hungry hurry idea if important in inch include
indeed inside instead interest into iron is island it its job join journey jump just keep kept key
kind king kitchen knew know lady lake land language large last late laugh law lay lead learn least
leave left leg less let letter level lie life lift light like line list listen little live long
look lose loud love low lunch machine made main make man many map mark market matter may maybe me
mean measure meat meet member memory middle might mile milk million mind minute miss modern moment
money month moon more morning most mother mountain mouth move much music must my name nation
nature near necessary neck need neighbour never new news next nice night nine no noise none noon nor
north nose not note nothing notice now number object ocean of off offer office often oh oil old on
once one only open or order other our out outside over own page paint pair paper parent park part
party pass past path pay peace people perhaps person phone pick picture piece place plan plant play
please pocket point poor possible pound power present pretty probably problem produce promise pull
push put queen question quick quiet quite race radio rain raise ran reach read ready real reason
receive record red remember repeat reply rest result return rich ride right ring rise river road
rock roll room round rule run safe said sail salt same sand sat save saw say school science sea
season seat second see seem sell send sense sentence serve set seven several shall shape share she
ship shirt shoe shop short should shoulder shout show side sign silent silver simple since sing
sister sit six size skin sky sleep slow small smell smile snow so soft soil some someone something
sometimes son song soon sorry sort sound south space speak special speed spend spoke spring square
stand star start station stay step still stone stop store story straight strange street strong
student study subject such sudden sugar suggest summer sun supper sure surprise sweet swim system
table tail take talk tall taste teach team tell ten test than thank that the their them then there
these they thick thin thing think third this those though thought thousand three through throw
ticket tie till time tiny tired to today together told tomorrow tone tonight too took top total
touch toward town track trade train travel tree trip trouble true try turn twelve twenty two type
uncle under understand until up upon us use usual valley very village visit voice wait walk wall
want war warm was wash watch water wave way we wear weather week weight welcome well went were west
what wheel when where whether which while white who whole why wide wife wild will win wind window
winter wish with without woman wonder wood word work world would write wrong yard year yellow yes
yesterday yet you young your zero
"""
_WORDS = _WORDS.split()

MAX_VOCAB_SIZE = 2048  # comfortably below what the built-in text can support
