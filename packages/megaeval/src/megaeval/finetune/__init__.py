"""BERT fine-tuning tasks of the Megatron-LM paper (Table 5): MNLI, QQP, SQuAD 1.1/2.0, RACE.

`readers` reads the datasets in their official formats (GLUE TSVs, SQuAD JSON, the RACE
directory tree) and names every row it cannot use; `metrics` computes the scores exactly as
the official scripts do (GLUE accuracy/F1, SQuAD evaluate-v1.1.py and evaluate-v2.0.py,
RACE accuracy). Neither depends on the model.
"""
