"""Fashion-MNIST example for Ember: data set-up (``data``), the TensorFlow
model and node functions (``model``), and the main job (``main``)."""
