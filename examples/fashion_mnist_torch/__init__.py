"""Fashion-MNIST with PyTorch on Spark through ember.spark.run (see main.py)."""
