"""An attention layer's scores (`<attention>.scores`): the logits its softmax receives,
after scaling, soft-cap, bias and mask, in the model's own layout. TransformerLens's
`hook_attn_scores`.

Every attention the engine sees forms its weights with `jax.nn.softmax`: called by the
layer itself (Gemma, Haiku), inside its library's weights function (Flax's and
Equinox's `dot_product_attention_weights`, Hugging Face's Flax models), or inside the
engine's own form of `jax.nn.dot_product_attention`. The argument of that call is the
scores, so they are selectable with the weights in one pass (`**.weights`,
`**.scores`), and a hook editing them changes the weights as the softmax predicts.
"""

import jax

from ._inner_sites import InnerKind, attention_argument_site

SCORES = InnerKind("scores", "attention_scores")

attention_argument_site(SCORES, jax.nn.softmax, 0)
