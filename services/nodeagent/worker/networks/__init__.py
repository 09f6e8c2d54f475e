"""The real architectures the worker trains, as networks: compact definitions of our own,
layer for layer those of the published models (the parameter counts in
:mod:`..registry` are what these build). One module per kind: vision.py (ResNet, VGG,
ShuffleNet V2, GoogLeNet, Inception v3, YOLOv3), language.py (BERT, GPT-2, the
Transformer, the LSTM language model), speech.py (DeepSpeech2), recommendation.py (NCF)
and atari.py (DQN, A2C). What each trains on and its loss: ..tasks; the input layer and
which network a model name builds: ..architectures."""
