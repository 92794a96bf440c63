// DsaIndexerKCacheWrite: quantises (fp8: e4m3 + one pow2 fp32 scale per token) or copies (bf16) the
// indexer keys of T tokens into the indexer pool at slot_mapping, in place (output 0 aliases input
// 2). Semantics: plugins/reference.py indexer_k_cache_write; kernel: dsa_launch_indexer_k_cache_write.
#include "plugin_common.h"

namespace dsa_trt
{
namespace
{

class IndexerKCacheWritePlugin : public PoolWritePlugin<IndexerKCacheWritePlugin>
{
public:
    enum Input : int32_t
    {
        kIndexK = 0,      // [T, 128] bf16 (normed, roped, Hadamard-rotated)
        kSlotMapping = 1, // [T] int64, -1 = skip
        kPool = 2,        // fp8 [P, 8448] bytes; bf16 [P, 64, 128]
    };
    // output kPoolOut = 0 aliases kPool (PoolWritePlugin)

    static constexpr char kName[] = "DsaIndexerKCacheWrite";
    static constexpr FieldSpec kFields[] = {{"cache_format", FieldKind::kInt}};
    static constexpr int32_t kNbInputs = 3;
    static constexpr int32_t kNbOutputs = 1;

    explicit IndexerKCacheWritePlugin(FieldValues const& f)
        : mCacheFormat(f.cacheFormat())
    {
    }

    void serialize(SerialFields& s) const
    {
        s.addInt("cache_format", &mCacheFormat);
    }

    bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* io) const
    {
        nv::DataType const t = io[pos].desc.type;
        switch (pos)
        {
        case kIndexK: return t == nv::DataType::kBF16;
        case kSlotMapping: return t == nv::DataType::kINT64;
        case kPool: return isPoolType(mCacheFormat, t);
        default: return t == io[kPool].desc.type; // the aliased pool
        }
    }

    void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* /*out*/) const
    {
        expectRank(in[kIndexK].dims, 2, "index_k");
        expectDim(in[kIndexK].dims, 1, DSA_INDEX_DIM, "index_k");
        expectRank(in[kSlotMapping].dims, 1, "slot_mapping");
        expectSameDim(in[kSlotMapping].dims, 0, "slot_mapping", in[kIndexK].dims, 0, "index_k");
        checkIndexerPool(in[kPool], mCacheFormat, "pool");
    }

    int launch(nv::PluginTensorDesc const* inDesc, nv::PluginTensorDesc const* /*outDesc*/,
        void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) const
    {
        expectAliased(inputs[kPool], outputs[kPoolOut], kPool);
        DsaIndexerKCacheWriteParams p{};
        p.index_k = inputs[kIndexK];
        p.slot_mapping = static_cast<int64_t const*>(inputs[kSlotMapping]);
        p.pool = outputs[kPoolOut];
        p.num_tokens = inDesc[kIndexK].dims.d[0];
        p.index_k_stride = DSA_INDEX_DIM; // TensorRT linear format: contiguous rows
        p.num_slots = inDesc[kPool].dims.d[0] * DSA_PAGE_SIZE;
        p.format = mCacheFormat;
        if (p.num_tokens == 0)
            return DSA_OK; // an empty step writes nothing; no zero-block launch
        return dsa_launch_indexer_k_cache_write(&p, stream);
    }

private:
    int32_t mCacheFormat; // DsaCacheFormat
};

} // namespace

nv::IPluginCreatorV3One& indexerKCacheWriteCreator() noexcept
{
    static PluginCreator<IndexerKCacheWritePlugin> creator;
    return creator;
}

} // namespace dsa_trt
