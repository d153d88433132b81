"""Models no one here wrote, at toy size, for tests/accumulator/test_conformance.py.

* KerasHub backbones, random init, built offline from their constructors (no preset,
  no download): each with a small regression head (pooled output -> Dense).
* Keras layers as keras.io writes them: `TokenAndPositionEmbedding` (the text
  classification and miniature-GPT examples: `self.pos_emb(ops.arange(0, maxlen))`
  beside a per-token `Embedding`) with the example's `TransformerBlock`, and the
  `Patches`/`PatchEncoder` of "Image classification with Vision Transformer".
* A CLIP-style model: KerasHub's ViT as the image tower, the keras.io text layers as
  the text tower, scored by the library's `contrastive.symmetric_info_nce`.

Every dropout rate is 0: random draws differ between the large batch and its
micro-batches by design, so they are left out of an exactness check.
"""

import keras
import keras_hub
import numpy as np
from keras import layers, ops

from tfx_gradient_accumulator.accumulator.cache import contrastive
from tests.accumulator.test_lookups import PatchEncoder, TokenAndPositionEmbedding  # keras.io's, as written

VOCAB, LENGTH, HIDDEN, INTERMEDIATE = 100, 8, 16, 32
IMAGE, PATCH = (8, 8, 3), 4

_TEXT = dict(vocabulary_size=VOCAB, num_layers=1, hidden_dim=HIDDEN, intermediate_dim=INTERMEDIATE)
_BERT_LIKE = dict(_TEXT, num_heads=2, dropout=0.0, max_sequence_length=LENGTH)
_DECODER = dict(_TEXT, num_query_heads=2, num_key_value_heads=1)
_VISION = dict(patch_size=PATCH, hidden_dim=HIDDEN, num_layers=1, num_heads=2, intermediate_dim=INTERMEDIATE,
               image_shape=IMAGE)

# name: (backbone class name in keras_hub.models, constructor arguments, inputs it takes)
# inputs: "text" token_ids + padding_mask, "segments" also segment_ids, "fnet" token_ids +
# segment_ids, "seq2seq" encoder_/decoder_ token_ids and padding_mask, "image" images.
HUB = {
    "albert": ("AlbertBackbone", dict(_BERT_LIKE, embedding_dim=8), "segments"),
    "bart": ("BartBackbone", _BERT_LIKE, "seq2seq"),
    "bert": ("BertBackbone", _BERT_LIKE, "segments"),
    "bloom": ("BloomBackbone", dict(_TEXT, num_heads=2, dropout=0.0), "text"),
    "clip_vision": ("CLIPVisionEncoder", _VISION, "image"),
    "deberta_v3": ("DebertaV3Backbone", dict(_BERT_LIKE, bucket_size=4), "text"),
    "distil_bert": ("DistilBertBackbone", _BERT_LIKE, "text"),
    "electra": ("ElectraBackbone", dict(vocab_size=VOCAB, num_layers=1, hidden_dim=HIDDEN, embedding_dim=8,
                                        intermediate_dim=INTERMEDIATE, num_heads=2, dropout=0.0,
                                        max_sequence_length=LENGTH), "segments"),
    "falcon": ("FalconBackbone", dict(_TEXT, num_attention_heads=2), "text"),
    "f_net": ("FNetBackbone", dict(_TEXT, dropout=0.0, max_sequence_length=LENGTH), "fnet"),
    "gemma": ("GemmaBackbone", dict(_DECODER, head_dim=8), "text"),
    "gpt2": ("GPT2Backbone", _BERT_LIKE, "text"),
    "gpt_neo_x": ("GPTNeoXBackbone", dict(_BERT_LIKE), "text"),
    "llama": ("LlamaBackbone", _DECODER, "text"),
    "mistral": ("MistralBackbone", dict(_DECODER, sliding_window=LENGTH), "text"),
    "opt": ("OPTBackbone", _BERT_LIKE, "text"),
    "phi3": ("Phi3Backbone", dict(_DECODER, max_sequence_length=LENGTH, pretraining_sequence_length=LENGTH),
             "text"),
    "qwen": ("QwenBackbone", _DECODER, "text"),
    "roberta": ("RobertaBackbone", _BERT_LIKE, "text"),
    "siglip_vision": ("SigLIPVisionEncoder", _VISION, "image"),
    "t5": ("T5Backbone", dict(_TEXT, num_heads=2, dropout=0.0), "seq2seq"),
    "vit": ("ViTBackbone", dict(image_shape=IMAGE, patch_size=PATCH, num_layers=1, num_heads=2,
                                hidden_dim=HIDDEN, mlp_dim=INTERMEDIATE), "image"),
    "xlm_roberta": ("XLMRobertaBackbone", _BERT_LIKE, "text"),
}


def hub_inputs(kind, samples, seed=0):
    """Deterministic inputs of one kind: ids in [1, VOCAB), lengths 5 to 8 (then padding)."""
    rng = np.random.RandomState(seed)
    if kind == "image":
        return rng.rand(samples, *IMAGE).astype("float32")
    ids = rng.randint(1, VOCAB, (samples, LENGTH)).astype("int32")
    mask = (np.arange(LENGTH)[None, :] < rng.randint(5, LENGTH + 1, (samples, 1))).astype("int32")
    ids = ids * mask
    if kind == "seq2seq":
        return {"encoder_token_ids": ids, "encoder_padding_mask": mask,
                "decoder_token_ids": np.roll(ids, 1, axis=0), "decoder_padding_mask": np.roll(mask, 1, axis=0)}
    segments = (np.arange(LENGTH)[None, :] >= LENGTH // 2).astype("int32") * mask
    if kind == "fnet":
        return {"token_ids": ids, "segment_ids": segments}
    features = {"token_ids": ids, "padding_mask": mask}
    if kind == "segments":
        features["segment_ids"] = segments
    return features


def _pooled(outputs):
    """One vector per sample from whatever a backbone returns."""
    if isinstance(outputs, dict):
        if "pooled_output" in outputs:
            return outputs["pooled_output"]
        return layers.Concatenate()([_pooled(outputs[k]) for k in sorted(outputs)])
    return layers.GlobalAveragePooling1D()(outputs) if len(outputs.shape) == 3 else outputs


def hub_model(name, seed=1):
    """KerasHub's backbone `name` (random init) with a Dense(1) head, weights fixed by `seed`."""
    class_name, config, kind = HUB[name]
    keras.utils.set_random_seed(seed)
    backbone = getattr(keras_hub.models, class_name)(**config)
    example = hub_inputs(kind, 1)
    if kind == "image":
        inputs = keras.Input(IMAGE)
    else:
        inputs = {k: keras.Input((LENGTH,), dtype="int32", name=k) for k in example}
    return keras.Model(inputs, layers.Dense(1)(_pooled(backbone(inputs))))


# ------------------------------------------------------------------ keras.io's layers
# As the examples write them (Keras 3 versions), dropout rates set to 0.

class TransformerBlock(layers.Layer):
    """keras.io, "Text classification with Transformer"."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.0):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class Patches(layers.Layer):
    """keras.io, "Image classification with Vision Transformer"."""

    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        input_shape = ops.shape(images)
        batch_size = input_shape[0]
        height = input_shape[1]
        width = input_shape[2]
        channels = input_shape[3]
        num_patches_h = height // self.patch_size
        num_patches_w = width // self.patch_size
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        patches = ops.reshape(
            patches,
            (batch_size, num_patches_h * num_patches_w, self.patch_size * self.patch_size * channels),
        )
        return patches


def keras_io_text_classifier(seed=1):
    """The text-classification example's model, at toy size (its head: pooled -> Dense)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=(LENGTH,), dtype="int32")
    x = TokenAndPositionEmbedding(LENGTH, VOCAB, HIDDEN)(inputs)
    x = TransformerBlock(HIDDEN, 2, INTERMEDIATE)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(20, activation="relu")(x)
    return keras.Model(inputs, layers.Dense(1)(x))


def keras_io_vit(seed=1):
    """The ViT example's model (patches, encoder, one transformer layer), at toy size."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input(shape=IMAGE)
    num_patches = (IMAGE[0] // PATCH) * (IMAGE[1] // PATCH)
    encoded = PatchEncoder(num_patches, HIDDEN)(Patches(PATCH)(inputs))
    x1 = layers.LayerNormalization(epsilon=1e-6)(encoded)
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=HIDDEN)(x1, x1)
    x2 = layers.Add()([attention, encoded])
    x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
    x3 = layers.Dense(INTERMEDIATE, activation=keras.activations.gelu)(x3)
    x3 = layers.Dense(HIDDEN, activation=keras.activations.gelu)(x3)
    encoded = layers.Add()([x3, x2])
    x = layers.Flatten()(layers.LayerNormalization(epsilon=1e-6)(encoded))
    return keras.Model(inputs, layers.Dense(1)(layers.Dense(INTERMEDIATE, activation="gelu")(x)))


# ------------------------------------------------------------------ a loss that couples the batch

class HubClip(keras.Model):
    """CLIP-style: KerasHub's ViT as the image tower, keras.io's layers as the text tower."""

    def __init__(self, dim=8, **kwargs):
        super().__init__(**kwargs)
        self.image = keras.Sequential([keras_hub.models.ViTBackbone(**HUB["vit"][1]),
                                       layers.GlobalAveragePooling1D(), layers.Dense(dim)])
        self.text = keras.Sequential([TokenAndPositionEmbedding(LENGTH, VOCAB, HIDDEN),
                                      layers.GlobalAveragePooling1D(), layers.Dense(dim)])
        self.logit_scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(np.log(1 / 0.07)),
                                           name="logit_scale")

    def call(self, inputs):
        return {"image": self.image(inputs["image"]), "text": self.text(inputs["text"])}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return contrastive.symmetric_info_nce(y_pred["image"], y_pred["text"], self.logit_scale)


def clip_pairs(samples, seed=0):
    """Images that depend on their captions' ids, so the towers have something to align."""
    rng = np.random.RandomState(seed)
    text = rng.randint(0, VOCAB, (samples, LENGTH)).astype("int32")
    image = np.eye(VOCAB, int(np.prod(IMAGE)))[text].mean(1).reshape(samples, *IMAGE)
    return {"image": (image + 0.1 * rng.rand(samples, *IMAGE)).astype("float32"), "text": text}


def hub_clip(seed=1):
    keras.utils.set_random_seed(seed)
    model = HubClip()
    model({k: v[:2] for k, v in clip_pairs(2).items()})
    return model


# ------------------------------------------------------------------ sentence pairs
# What users fine-tune on pairs of sentences: KerasHub's BERT classifier fed by its own
# preprocessor (token-type ids 0 then 1: data), and a sentence-embedding model in
# sentence-transformers' style, one BERT encoder called on anchors then positives, whose
# token-type ids are zeros shaped like the batch (a constant of the program).

PAIR_WORDS = 60
PAIR_VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(PAIR_WORDS)]
PAIR_LENGTH = 12


def _sentence(rng):
    return " ".join(f"w{i}" for i in rng.randint(0, PAIR_WORDS, rng.randint(2, 6)))


def sentence_pairs(samples, seed=0):
    """(first sentences, second sentences, labels 0/1), strings of 2 to 5 words."""
    rng = np.random.RandomState(seed)
    first = [_sentence(rng) for _ in range(samples)]
    second = [_sentence(rng) for _ in range(samples)]
    return np.array(first), np.array(second), rng.randint(0, 2, samples).astype("int32")


def bert_pair_features(samples, seed=0):
    """The pairs as KerasHub's BertTextClassifierPreprocessor packs them ([CLS] a [SEP] b [SEP],
    segment ids 0 then 1), computed once: arrays for `fit`."""
    first, second, labels = sentence_pairs(samples, seed)
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=PAIR_VOCABULARY)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer, sequence_length=PAIR_LENGTH)
    features = preprocessor(x=(first, second))
    return {k: np.asarray(v) for k, v in features.items()}, labels


def _pair_backbone():
    return keras_hub.models.BertBackbone(vocabulary_size=len(PAIR_VOCABULARY), num_layers=1, num_heads=2,
                                         hidden_dim=HIDDEN, intermediate_dim=INTERMEDIATE,
                                         max_sequence_length=PAIR_LENGTH, dropout=0.0)


def bert_pair_classifier(seed=1):
    """KerasHub's BertTextClassifier (random init), preprocessing done by `bert_pair_features`."""
    keras.utils.set_random_seed(seed)
    return keras_hub.models.BertTextClassifier(_pair_backbone(), num_classes=2, preprocessor=None, dropout=0.0)


def sentence_ids(samples, seed=0):
    """{"anchor", "positive"}: [CLS] words [SEP] ids, the positive sharing most of its anchor's words."""
    rng = np.random.RandomState(seed)
    words = rng.randint(5, len(PAIR_VOCABULARY), (samples, PAIR_LENGTH - 2))
    lengths = rng.randint(3, PAIR_LENGTH - 1, (samples, 1))
    positive_words = np.where(rng.rand(*words.shape) < 0.7, words, rng.randint(5, len(PAIR_VOCABULARY), words.shape))

    def packed(w):
        ids = np.concatenate([np.full((samples, 1), 2), w, np.zeros((samples, 1))], axis=1)
        ids[np.arange(samples), lengths[:, 0] + 1] = 3
        return (ids * (np.arange(PAIR_LENGTH)[None, :] <= lengths + 1)).astype("int32")
    return {"anchor": packed(words), "positive": packed(positive_words)}


class SentenceEncoder(layers.Layer):
    """sentence-transformers' recipe on KerasHub's BERT: ids in, the mean of the unmasked
    token vectors out; token-type ids of zeros, padding mask from the ids."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.backbone = _pair_backbone()

    def call(self, token_ids):
        mask = ops.not_equal(token_ids, 0)
        sequence = self.backbone({"token_ids": token_ids, "segment_ids": ops.zeros_like(token_ids),
                                  "padding_mask": mask})["sequence_output"]
        weights = ops.expand_dims(ops.cast(mask, sequence.dtype), -1)
        return ops.sum(sequence * weights, axis=1) / ops.sum(weights, axis=1)


class SentenceEmbedder(keras.Model):
    """One encoder for anchors and positives, in-batch negatives: sentence-transformers'
    MultipleNegativesRankingLoss (cosine similarities scaled by 20, cross-entropy on the diagonal)."""

    def __init__(self, scale=20.0, **kwargs):
        super().__init__(**kwargs)
        self.encoder = SentenceEncoder()
        self.scale = scale

    def call(self, inputs):
        return {"anchor": self.encoder(inputs["anchor"]), "positive": self.encoder(inputs["positive"])}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        anchor = ops.normalize(y_pred["anchor"], axis=1)
        positive = ops.normalize(y_pred["positive"], axis=1)
        return contrastive.in_batch_softmax(anchor, positive, temperature=1 / self.scale)


def sentence_embedder(seed=1):
    keras.utils.set_random_seed(seed)
    model = SentenceEmbedder()
    model({k: v[:2] for k, v in sentence_ids(2).items()})
    return model


def sentence_similarity(seed=1):
    """The same encoder trained on a per-sample loss (sentence-transformers' CosineSimilarityLoss):
    the cosine of the two embeddings, regressed on a score."""
    keras.utils.set_random_seed(seed)
    inputs = {name: keras.Input((PAIR_LENGTH,), dtype="int32", name=name) for name in ("anchor", "positive")}
    encoder = SentenceEncoder()
    cosine = layers.Dot(axes=1, normalize=True)([encoder(inputs["anchor"]), encoder(inputs["positive"])])
    return keras.Model(inputs, cosine)
