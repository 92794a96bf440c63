// DsaMlaCacheWrite: stores [kv_latent ; k_pe] of T tokens into the MLA pool at slot_mapping, in place
// (output 0 aliases input 3). Semantics: plugins/reference.py mla_cache_write; kernel:
// dsa_launch_mla_cache_write. Contract: PLUGINS.md.
#include "plugin_common.h"

namespace dsa_trt
{
namespace
{

constexpr int64_t kRopeDim = DSA_MLA_DIM - DSA_MLA_V_DIM; // 64

class MlaCacheWritePlugin : public PoolWritePlugin<MlaCacheWritePlugin>
{
public:
    enum Input : int32_t
    {
        kKvLatent = 0,    // [T, 512] bf16
        kKPe = 1,         // [T, 64] bf16
        kSlotMapping = 2, // [T] int64, -1 = skip
        kPool = 3,        // [P, 64, 576] bytes (fp8) or bf16
    };
    // output kPoolOut = 0 aliases kPool (PoolWritePlugin)

    static constexpr char kName[] = "DsaMlaCacheWrite";
    static constexpr FieldSpec kFields[] = {{"kv_scale", FieldKind::kFloat}, {"cache_format", FieldKind::kInt}};
    static constexpr int32_t kNbInputs = 4;
    static constexpr int32_t kNbOutputs = 1;

    explicit MlaCacheWritePlugin(FieldValues const& f)
        : mKvScale(f.positiveFloat("kv_scale"))
        , mCacheFormat(f.cacheFormat())
    {
    }

    void serialize(SerialFields& s) const
    {
        s.addFloat("kv_scale", &mKvScale);
        s.addInt("cache_format", &mCacheFormat);
    }

    bool supportsType(int32_t pos, nv::DynamicPluginTensorDesc const* io) const
    {
        nv::DataType const t = io[pos].desc.type;
        switch (pos)
        {
        case kKvLatent:
        case kKPe: return t == nv::DataType::kBF16;
        case kSlotMapping: return t == nv::DataType::kINT64;
        case kPool: return isPoolType(mCacheFormat, t);
        default: return t == io[kPool].desc.type; // the aliased pool
        }
    }

    void checkShapes(nv::PluginTensorDesc const* in, nv::PluginTensorDesc const* /*out*/) const
    {
        expectRank(in[kKvLatent].dims, 2, "kv_latent");
        expectDim(in[kKvLatent].dims, 1, DSA_MLA_V_DIM, "kv_latent");
        expectRank(in[kKPe].dims, 2, "k_pe");
        expectDim(in[kKPe].dims, 1, kRopeDim, "k_pe");
        expectRank(in[kSlotMapping].dims, 1, "slot_mapping");
        expectSameDim(in[kKPe].dims, 0, "k_pe", in[kKvLatent].dims, 0, "kv_latent");
        expectSameDim(in[kSlotMapping].dims, 0, "slot_mapping", in[kKvLatent].dims, 0, "kv_latent");
        checkMlaPool(in[kPool], mCacheFormat, "pool");
    }

    int launch(nv::PluginTensorDesc const* inDesc, nv::PluginTensorDesc const* /*outDesc*/,
        void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) const
    {
        expectAliased(inputs[kPool], outputs[kPoolOut], kPool);
        DsaMlaCacheWriteParams p{};
        p.kv_latent = inputs[kKvLatent];
        p.k_pe = inputs[kKPe];
        p.slot_mapping = static_cast<int64_t const*>(inputs[kSlotMapping]);
        p.pool = outputs[kPoolOut];
        p.num_tokens = inDesc[kKvLatent].dims.d[0];
        p.kv_latent_stride = DSA_MLA_V_DIM; // TensorRT linear format: contiguous rows
        p.k_pe_stride = kRopeDim;
        p.num_slots = inDesc[kPool].dims.d[0] * DSA_PAGE_SIZE;
        p.kv_scale = mKvScale;
        p.format = mCacheFormat;
        if (p.num_tokens == 0)
            return DSA_OK; // an empty step writes nothing; no zero-block launch
        return dsa_launch_mla_cache_write(&p, stream);
    }

private:
    float mKvScale;       // fp8: stored = e4m3(x / kv_scale); unused (but kept) in bf16 mode
    int32_t mCacheFormat; // DsaCacheFormat
};

} // namespace

nv::IPluginCreatorV3One& mlaCacheWriteCreator() noexcept
{
    static PluginCreator<MlaCacheWritePlugin> creator;
    return creator;
}

} // namespace dsa_trt
