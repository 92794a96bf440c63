// DsaIndexerLogits (paged): logits[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s]) * k_scale[s] for
// s < seq_lens[t], -inf beyond; keys gathered through page_table[req_idx[t]] from the indexer pool.
// Semantics: plugins/reference.py indexer_logits; kernel: dsa_launch_indexer_logits.
#include "plugin_common.h"

namespace dsa_trt
{
namespace
{

class IndexerLogitsPlugin : public PluginBase<IndexerLogitsPlugin>
{
public:
    enum Input : int32_t
    {
        kQ = 0,         // [T, H, 128] fp8 e4m3 (cache_format 0) or bf16 (1)
        kWeights = 1,   // [T, H] fp32, q scales and 1/sqrt(d), 1/sqrt(H) folded in
        kPool = 2,      // indexer pool: fp8 [P, 8448] bytes; bf16 [P, 64, 128]
        kPageTable = 3, // [B, max_pages] int32
        kReqIdx = 4,    // [T] int32: row of page_table of each query token
        kSeqLens = 5,   // [T] int32: visible keys of each query token
    };
    static constexpr int32_t kLogits = 0; // [T, max_pages * 64] fp32

    static constexpr char kName[] = "DsaIndexerLogits";
    static constexpr FieldSpec kFields[] = {{"num_heads", FieldKind::kInt}, {"cache_format", FieldKind::kInt}};
    static constexpr int32_t kNbInputs = 6;
    static constexpr int32_t kNbOutputs = 1;

    explicit IndexerLogitsPlugin(FieldValues const& f)
        : mNumHeads(f.intInRange("num_heads", 1, 1024))
        , mCacheFormat(f.cacheFormat())
    {
    }

    void serialize(SerialFields& s) const
    {
        s.addInt("num_heads", &mNumHeads);
        s.addInt("cache_format", &mCacheFormat);
    }

    bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* io) const
    {
        nv::DataType const t = io[pos].desc.type;
        switch (pos)
        {
        case kQ: return t == (mCacheFormat == DSA_CACHE_FP8 ? nv::DataType::kFP8 : nv::DataType::kBF16);
        case kWeights: return t == nv::DataType::kFLOAT;
        case kPool: return isPoolType(mCacheFormat, t);
        case kPageTable:
        case kReqIdx:
        case kSeqLens: return t == nv::DataType::kINT32;
        default: return t == nv::DataType::kFLOAT; // logits
        }
    }

    void outputTypes(nv::DataType* out, nv::DataType const* /*in*/) const
    {
        out[kLogits] = nv::DataType::kFLOAT;
    }

    void outputShapes(nv::DimsExprs const* in, nv::DimsExprs* out, nv::IExprBuilder& eb) const
    {
        DSA_TRT_REQUIRE(in[kQ].nbDims == 3 && in[kPageTable].nbDims == 2, "q must have rank 3, page_table rank 2");
        out[kLogits].nbDims = 2;
        out[kLogits].d[0] = in[kQ].d[0];
        out[kLogits].d[1]
            = eb.operation(nv::DimensionOperation::kPROD, *in[kPageTable].d[1], *eb.constant(DSA_PAGE_SIZE));
    }

    void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* /*out*/) const
    {
        nv::Dims const& q = in[kQ].dims;
        expectRank(q, 3, "q");
        expectDim(q, 1, mNumHeads, "q");
        expectDim(q, 2, DSA_INDEX_DIM, "q");
        expectRank(in[kWeights].dims, 2, "weights");
        expectSameDim(in[kWeights].dims, 0, "weights", q, 0, "q");
        expectDim(in[kWeights].dims, 1, mNumHeads, "weights");
        checkIndexerPool(in[kPool], mCacheFormat, "pool");
        expectRank(in[kPageTable].dims, 2, "page_table");
        expectRank(in[kReqIdx].dims, 1, "req_idx");
        expectSameDim(in[kReqIdx].dims, 0, "req_idx", q, 0, "q");
        expectRank(in[kSeqLens].dims, 1, "seq_lens");
        expectSameDim(in[kSeqLens].dims, 0, "seq_lens", q, 0, "q");
        if (in[kPageTable].dims.d[1] >= 0)
            expectInt32(in[kPageTable].dims.d[1] * DSA_PAGE_SIZE, "logits width (max_pages * 64)");
    }

    int launch(nv::PluginTensorDesc const* inDesc, nv::PluginTensorDesc const* /*outDesc*/,
        void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) const
    {
        int64_t const maxPages = inDesc[kPageTable].dims.d[1];
        DsaIndexerLogitsParams p{};
        p.q = inputs[kQ];
        p.weights = static_cast<float const*>(inputs[kWeights]);
        p.pool = inputs[kPool];
        p.page_table = static_cast<int32_t const*>(inputs[kPageTable]);
        p.req_idx = static_cast<int32_t const*>(inputs[kReqIdx]);
        p.seq_lens = static_cast<int32_t const*>(inputs[kSeqLens]);
        p.logits = static_cast<float*>(outputs[kLogits]);
        p.num_tokens = inDesc[kQ].dims.d[0];
        p.num_heads = mNumHeads;
        p.max_pages = static_cast<int>(maxPages);
        p.logits_stride = maxPages * DSA_PAGE_SIZE; // the output is exactly [T, max_pages * 64]
        p.format = mCacheFormat;
        p.num_requests = static_cast<int>(inDesc[kPageTable].dims.d[0]);
        if (p.num_tokens == 0 || maxPages == 0)
            return DSA_OK; // empty output: nothing to write
        return dsa_launch_indexer_logits(&p, stream);
    }

private:
    int32_t mNumHeads;    // 64 (V3.2) or 32 (GLM-5); the kernel names unsupported values
    int32_t mCacheFormat; // DsaCacheFormat of the indexer pool (and of q: fp8 or bf16)
};

} // namespace

nv::IPluginCreatorV3One& indexerLogitsCreator() noexcept
{
    static PluginCreator<IndexerLogitsPlugin> creator;
    return creator;
}

} // namespace dsa_trt
