"""BibTeX of the methods the losses implement, for the model cards sentence-transformers writes."""


def _arxiv(
    key: str, *, title: str, author: str, year: int, eprint: str, booktitle: str = "", primary_class: str = ""
) -> str:
    """One entry as its source prints it, between blank lines (a loss's ``citation`` joins them): a conference paper
    (``booktitle``) as ``@inproceedings``, else ``@misc``, one field a line in BibTeX's usual order."""
    fields = {"title": title, "author": author, "booktitle": booktitle, "year": year, "eprint": eprint}
    fields.update(archivePrefix="arXiv", primaryClass=primary_class)
    body = ",\n".join(f"    {name}={{{value}}}" for name, value in fields.items() if value)
    return f"\n@{'inproceedings' if booktitle else 'misc'}{{{key},\n{body}\n}}\n"


# One entry a line: data, kept from the formatter, which would spread each call over as many lines as BibTeX.
# fmt: off
GRADCACHE = _arxiv("gao2021scaling", title="Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup", author="Luyu Gao and Yunyi Zhang and Jiawei Han and Jamie Callan", year=2021, eprint="2101.06983", primary_class="cs.LG")
MATRYOSHKA = _arxiv("kusupati2024matryoshka", title="Matryoshka Representation Learning", author="Aditya Kusupati and Gantavya Bhatt and Aniket Rege and Matthew Wallingford and Aditya Sinha and Vivek Ramanujan and William Howard-Snyder and Kaifeng Chen and Sham Kakade and Prateek Jain and Ali Farhadi", year=2024, eprint="2205.13147", primary_class="cs.LG")
GISTEMBED = _arxiv("solatorio2024gistembed", title="GISTEmbed: Guided In-sample Selection of Training Negatives for Text Embedding Fine-tuning", author="Aivin V. Solatorio", year=2024, eprint="2402.16829", primary_class="cs.LG")
MATRYOSHKA_2D = _arxiv("li20242d", title="2D Matryoshka Sentence Embeddings", author="Xianming Li and Zongxi Li and Jing Li and Haoran Xie and Qing Li", year=2024, eprint="2402.14776", primary_class="cs.CL")
XBM = _arxiv("wang2020xbm", title="Cross-Batch Memory for Embedding Learning", author="Xun Wang and Haozhi Zhang and Weilin Huang and Matthew R. Scott", booktitle="Proceedings of the IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR)", year=2020, eprint="1912.06798")
CONTACCUM = _arxiv("kim2024contaccum", title="A Gradient Accumulation Method for Dense Retriever under Memory Constraint", author="Jaehee Kim and Yukyung Lee and Pilsung Kang", booktitle="Advances in Neural Information Processing Systems (NeurIPS)", year=2024, eprint="2406.12356")
COLBERT = _arxiv("khattab2020colbert", title="ColBERT: Efficient and Effective Passage Search via Contextualized Late Interaction over BERT", author="Omar Khattab and Matei Zaharia", booktitle="Proceedings of the 43rd International ACM SIGIR Conference on Research and Development in Information Retrieval", year=2020, eprint="2004.12832", primary_class="cs.IR")
SPLADE_HARD_NEGATIVES = _arxiv("formal2022distillationhardnegativesampling", title="From Distillation to Hard Negative Sampling: Making Sparse Neural IR Models More Effective", author="Thibault Formal and Carlos Lassance and Benjamin Piwowarski and St\\'ephane Clinchant", year=2022, eprint="2205.04733", primary_class="cs.IR")
# fmt: on
